"""The command line: generate, chat (streamed, over stdin; Ctrl-C, /reset, /exit) and clear
errors for a missing model."""
import os
import subprocess
import sys

import pytest

from conveyor.cli import main
from conveyor.shared.model_files import default_model_path

needs_model = pytest.mark.skipif(not default_model_path().is_file(),
                                 reason="default model not fetched (make model)")


@needs_model
def test_generate_prints_completions(capsys):
    assert main(["generate", "--max-tokens", "8", "--temperature", "0", "--max-num-seqs", "4",
                 "The capital of France is", "1, 2, 3,"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n\n") >= 2 and out.strip()


@needs_model
def test_generate_chat_mode(capsys):
    assert main(["generate", "--chat", "--echo", "--max-tokens", "24", "--max-num-seqs", "2",
                 "What is the capital of France?"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("What is the capital of France?\n") and "Paris" in out


def test_missing_model_is_one_clear_line(capsys, tmp_path):
    assert main(["generate", "--model", str(tmp_path / "nope"), "hi"]) == 2
    err = capsys.readouterr().err
    assert "no model at" in err and "Traceback" not in err


def test_missing_default_model_says_how_to_get_it(tmp_path):
    env = {**os.environ, "CONVEYOR_CACHE": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "conveyor.cli", "generate", "hi"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2
    assert "make model" in proc.stderr and str(tmp_path) in proc.stderr
    assert "Traceback" not in proc.stderr


def test_bad_engine_argument_is_a_clear_error(capsys):
    assert main(["generate", "--block-size", "3", "hi"]) == 2
    assert "block_size" in capsys.readouterr().err


@needs_model
def test_chat_streams_replies_ctrl_c_stops_one_then_reset_and_exit():
    """Ctrl-C during a reply stops it and the prompt comes back; /reset forgets the
    conversation; /exit quits with 0. In a second chat a question typed at the prompt gets its
    reply streamed (greedy: it names Paris) and the prompt again, where Ctrl-C exits cleanly."""
    import signal
    import threading
    import time

    proc = subprocess.Popen(
        [sys.executable, "-m", "conveyor.cli", "chat", "--max-tokens", "2000",
         "--max-num-seqs", "2", "--temperature", "0.8"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(iter(lambda: proc.stdout.read(1), "")),
                              daemon=True)
    reader.start()
    try:
        proc.stdin.write("Write a very long story about a dragon and a knight.\n")
        proc.stdin.flush()
        deadline = time.monotonic() + 240
        while len("".join(out)) < 20:                   # the reply is streaming
            assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read()
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        while "[stopped]" not in "".join(out):
            assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read()
            time.sleep(0.05)
        proc.stdin.write("/reset\n/exit\n")
        proc.stdin.flush()
        assert proc.wait(120) == 0
        reader.join(10)
        err = proc.stderr.read()
        assert "conversation forgotten" in err and "Traceback" not in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    at_prompt = subprocess.Popen(
        [sys.executable, "-m", "conveyor.cli", "chat", "--max-tokens", "40", "--max-num-seqs",
         "2"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert "conveyor chat:" in at_prompt.stderr.readline()   # the REPL is up
        assert at_prompt.stdout.read(2) == "> "                    # and waits at its prompt
        at_prompt.stdin.write("What is the capital of France?\n")
        at_prompt.stdin.flush()
        reply = ""
        while not reply.endswith("\n> "):                         # the reply, then the prompt
            char = at_prompt.stdout.read(1)
            assert char, (reply, at_prompt.stderr.read())
            reply += char
        assert "Paris" in reply
        time.sleep(0.2)
        at_prompt.send_signal(signal.SIGINT)
        _, err = at_prompt.communicate(timeout=60)
        assert at_prompt.returncode == 0 and "Traceback" not in err
    finally:
        if at_prompt.poll() is None:
            at_prompt.kill()
            at_prompt.wait()
