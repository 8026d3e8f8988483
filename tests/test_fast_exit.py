"""Commands end without the interpreter's teardown (fedal/fast_exit.py), and lose nothing by it:
the exit code, buffered output, log records, exit handlers and the threads the interpreter would
wait for are all as after `sys.exit`."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

PROGRAM = textwrap.dedent("""
    import atexit, logging, sys, threading, time
    from pathlib import Path
    import click
    from fedal.fast_exit import run_then_exit

    out = Path(sys.argv[1])
    logging.basicConfig(filename=out / "log.txt", level=logging.INFO)
    atexit.register(lambda: (out / "atexit.txt").write_text("ran"))

    @click.command()
    @click.argument("how")
    def command(how):
        sys.stdout.write("buffered, no newline")  # a pipe: block-buffered until flushed
        logging.info("a record")
        if how == "thread":
            def late():
                time.sleep(0.5)
                (out / "thread.txt").write_text("done")
            threading.Thread(target=late).start()
        if how == "message":
            sys.exit("refused: a message")
        if how == "raise":
            raise RuntimeError("boom")
        sys.exit({"code": 3, "thread": 0, "false": False}[how])

    run_then_exit(command, args=sys.argv[2:])
""")


def run(tmp_path: Path, how: str) -> subprocess.CompletedProcess:
    script = tmp_path / "program.py"
    script.write_text(PROGRAM)
    return subprocess.run([sys.executable, str(script), str(tmp_path), how], capture_output=True, text=True,
                          timeout=60)


@pytest.mark.parametrize(("how", "code"), [("code", 3), ("thread", 0), ("message", 1), ("raise", 1), ("false", 0)])
def test_a_command_ends_with_its_code_and_loses_nothing(tmp_path, how, code):
    done = run(tmp_path, how)
    assert done.returncode == code, done.stderr
    assert done.stdout == "buffered, no newline"
    assert "INFO:root:a record" in (tmp_path / "log.txt").read_text()
    assert (tmp_path / "atexit.txt").read_text() == "ran"
    if how == "thread":  # a non-daemon thread still running: waited for, as sys.exit does
        assert (tmp_path / "thread.txt").read_text() == "done"
    if how == "message":
        assert done.stderr.strip() == "refused: a message"
    if how == "raise":  # not a command's exit: the traceback, as before
        assert "RuntimeError: boom" in done.stderr
    if how == "false":  # sys.exit(False): status 0, nothing said
        assert done.stderr == ""


def test_the_commands_use_it():
    """Every process the toolkit starts ends through it: the `fedal` command, the agent, the
    coordinator and hil (their `main`s and `python -m` entry points)."""
    import tomllib

    repo = Path(__file__).resolve().parents[1]
    assert tomllib.loads((repo / "pyproject.toml").read_text())["project"]["scripts"]["fedal"] == "fedal_cli.main:main"
    for path in ("fedal_cli/main.py", "edge_agent/cli.py", "coordinator/cli.py", "hil/cli.py"):
        assert "run_then_exit(" in (repo / path).read_text(), path
    for path in ("fedal_cli/__main__.py", "edge_agent/__main__.py", "coordinator/__main__.py", "hil/__main__.py"):
        assert "main()" in (repo / path).read_text(), path
