"""The life of a child process of `conveyor serve`: name it, tie it to the launcher, report.

`child_main` names the process (`conveyor::<name>`), makes it die with the launcher, runs the
role's main with a control socket to the launcher (the role sends Ready on it), and turns an
exception into an EngineDead on that socket and exit code 1.

Signals: Ctrl-C, `docker stop`, systemd and `kill -- -PGID` signal every process of the group,
not just the launcher. A child must not act on those: the launcher drains first and then stops
it. So children are born with SIGINT and SIGTERM ignored (`spawning_children`), and a child
exits on a SIGTERM only when the launcher itself sent it (`follow_launcher`).
"""
from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import sys
import threading
import time

import zmq

from conveyor.shared import links
from conveyor.shared.config import ServeConfig
from conveyor.shared.messages.control import EngineDead

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


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def spawning_children():
    """Around starting child processes: they inherit SIGINT and SIGTERM ignored (dispositions
    survive exec; handlers and the signal mask do not), so a signal to the whole group in the
    moments before a child runs `follow_launcher` cannot kill it.

    NOTE: the launcher's own stop signals are blocked meanwhile, not lost: Linux keeps a blocked
    signal pending even while its disposition is "ignore", and delivers it to the handler
    restored afterwards."""
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    handlers = {s: signal.signal(s, signal.SIG_IGN) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def follow_launcher(launcher_pid: int) -> None:
    """Ignore SIGINT; exit on a SIGTERM sent by the launcher, ignore one sent by anyone else.

    NOTE: a Python handler cannot see who sent a signal, so SIGTERM is blocked in every thread
    (threads started later inherit the mask) and one thread takes it with sigwaitinfo. It exits
    at once: the launcher owns every shared resource, and raising SystemExit could land inside
    a finaliser (a zmq socket's __del__) and print a stray traceback."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    signal.signal(signal.SIGTERM, signal.SIG_DFL)    # pending until taken below

    def wait() -> None:
        while True:
            info = signal.sigwaitinfo({signal.SIGTERM})
            if info.si_pid == launcher_pid:
                os._exit(0)

    threading.Thread(target=wait, name="sigterm-from-launcher", daemon=True).start()


def child_main(name: str, role_main, cfg: ServeConfig, *args) -> None:
    """Entry point of every child: role_main(ctx, control, cfg, *args) runs until shutdown."""
    follow_launcher(cfg.launcher_pid)                # first: before any other thread starts
    set_title(f"conveyor::{name}")
    die_with_parent(cfg.launcher_pid)
    os._exit(run_role(name, role_main, cfg, "launcher", *args))


def run_role(name: str, role_main, cfg: ServeConfig, control_link: str, *args) -> int:
    """role_main(ctx, control, cfg, *args), with `control` the link to the launcher named
    control_link (shared/links.py); an exception becomes an EngineDead there. The exit code."""
    logging.basicConfig(level=logging.WARNING, format=f"%(levelname)s {name}: %(message)s")
    ctx = zmq.Context()
    control = links.connect(ctx, zmq.PUSH, cfg, control_link)
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
    return code
