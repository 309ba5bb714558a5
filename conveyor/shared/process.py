"""The life of a child process of `conveyor serve`: name it, tie it to the launcher, report.

`child_main` names the process (`conveyor::<name>`), makes it die with the launcher, runs the
role's main with a control socket to the launcher (the role sends Ready on it), and turns an
exception into an EngineDead on that socket and exit code 1.
"""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
import time

import zmq

from conveyor.shared.config import ServeConfig
from conveyor.shared.messages.control import EngineDead
from conveyor.shared.sockets import Socket, ipc

log = logging.getLogger(__name__)

_PR_SET_NAME, _PR_SET_PDEATHSIG = 15, 1


class StartupError(RuntimeError):
    """A start-up failure the user can fix; its message is all they need (no traceback)."""


def set_title(title: str) -> None:
    try:
        import setproctitle
        setproctitle.setproctitle(title)
    except ImportError:
        _prctl(_PR_SET_NAME, ctypes.c_char_p(title.encode()[:15]))


def die_with_parent(parent_pid: int) -> None:
    """Exit when the launcher goes away: PR_SET_PDEATHSIG on Linux, a parent poll elsewhere."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(1)

    if os.getppid() != parent_pid:
        os._exit(1)
    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _prctl(option: int, arg) -> None:
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(option, arg, 0, 0, 0)


def _exit_on_sigterm(signum, frame) -> None:
    # NOTE: exit at once: raising SystemExit here can land inside a finaliser (a zmq socket's
    # __del__) and print a stray traceback; the launcher owns every shared resource anyway.
    os._exit(0)


def child_main(name: str, role_main, cfg: ServeConfig, *args) -> None:
    """Entry point of every child: role_main(ctx, control, cfg, *args) runs until shutdown."""
    set_title(f"conveyor::{name}")
    die_with_parent(cfg.launcher_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)     # Ctrl-C is the launcher's to handle
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    logging.basicConfig(level=logging.WARNING, format=f"%(levelname)s {name}: %(message)s")
    ctx = zmq.Context()
    control = Socket(ctx, zmq.PUSH, ipc(cfg.runtime_dir, "launcher"), bind=False)
    code = 0
    try:
        role_main(ctx, control, cfg, *args)
    except SystemExit:
        pass
    except BaseException as e:
        if not isinstance(e, StartupError):
            log.exception("%s failed", name)
        control.send(EngineDead(f"{name}: {e}", role=name))
        code = 1
    finally:
        control.close(linger_ms=1000)
        ctx.destroy(linger=0)
    os._exit(code)
