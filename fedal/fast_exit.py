"""The toolkit's commands end without the interpreter's teardown.

With torch loaded, Python's teardown (modules and their objects freed one by one, the native
libraries' destructors) takes 0.3-1 s on a server core, more on a Pi: time in every systemd stop
of an agent, every end of a coordinator and every `fedal` command, for nothing a finished
process still needs. A command's `main` runs it, then ends the process the way `sys.exit` would
have, minus that teardown: the exit handlers run (logging's flush and close among them), the
standard streams are flushed, and the process exits with the command's code. Where a thread the
interpreter would wait for still runs (a non-daemon thread), it exits normally instead.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
from collections.abc import Callable
from typing import Any, NoReturn


def run_then_exit(command: Callable[..., Any], **kwargs: Any) -> NoReturn:
    """`command(**kwargs)` (a click command in standalone mode: it raises SystemExit), then
    `exit_now` with its exit code. An uncaught exception is reported as the interpreter would
    (its traceback, exit status 1), also without the teardown: a daemon thread may still be
    computing, whose teardown aborted the process."""
    try:
        command(**kwargs)
        code: object = 0
    except SystemExit as exc:
        code = exc.code
    except Exception:
        sys.excepthook(*sys.exc_info())
        code = 1
    exit_now(code)


def exit_now(code: object = 0) -> NoReturn:
    """End the process with `code`, as `sys.exit(code)` would, without the interpreter's teardown."""
    if not isinstance(code, int):  # (a bool is an int here, as for sys.exit)
        if code is not None:  # what SystemExit("message") does: the message to stderr, status 1
            print(code, file=sys.stderr)
        code = 0 if code is None else 1
    waited = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon and t.is_alive()]
    if waited:
        sys.exit(code)  # the interpreter waits for them, as it always has
    try:
        atexit._run_exitfuncs()  # noqa: SLF001 - what the teardown would run first (logging's shutdown, ...)
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):  # closed, or its reader gone: nothing more reaches it
                stream.flush()
    finally:
        os._exit(code)
