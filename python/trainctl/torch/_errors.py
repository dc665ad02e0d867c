"""What the package raises when a loop cannot train right, and how a worker ends on it.

``UsageError``: a loop the package cannot make exact, refused before it changes anything.
``DivergedError``: the ranks no longer hold the same state. Either one would come back the same
way if the workers were started again (the same loop, the same state), so a worker that ends
on one exits with ``EXIT_UNRECOVERABLE`` (``contract::exit::UNRECOVERABLE``), which
``trainctl run`` never retries: the job fails at once, on every node, with this error as its
root cause. torchrun's error file (``TORCHELASTIC_ERROR_FILE``) gets the exception as
``@record`` writes it, marked, so that the launcher's report shows it whole. A program's own
exceptions end the process as Python ends it (exit 1), which ``trainctl run`` retries as
torchrun does.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import time
import traceback
from typing import Any

EXIT_UNRECOVERABLE = 76
"""``contract::exit::UNRECOVERABLE``: never retried."""

MARK = "unrecoverable"
"""The error file's ``extraInfo.trainctl``: what the launcher reads as never to retry."""


class UsageError(RuntimeError):
    """A use of ``trainctl.torch`` that it cannot make exact; the message says what to do."""


class DivergedError(RuntimeError):
    """The ranks no longer hold the same training state: training on would give a wrong model."""


UsageError.__module__ = "trainctl.torch"
DivergedError.__module__ = "trainctl.torch"


def unrecoverable(e: BaseException) -> bool:
    """Whether ``e`` ends the job rather than the attempt."""
    return isinstance(e, (UsageError, DivergedError))


def error_record(e: BaseException, tb: Any) -> dict[str, Any]:
    """``e`` as torchrun's ``@record`` writes it, marked unrecoverable."""
    return {
        "message": {
            "message": f"{type(e).__name__}: {e}",
            "extraInfo": {
                "py_callstack": "".join(traceback.format_exception(type(e), e, tb)),
                "timestamp": str(int(time.time())),
                "trainctl": MARK,
            },
        }
    }


def record(e: BaseException, tb: Any) -> None:
    """Writes ``e`` (unrecoverable) to the error file, when the launcher asked for one."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        tmp = f"{path}.tmp.{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(error_record(e, tb), f)
        os.replace(tmp, path)
    except OSError as problem:
        print(f"trainctl.torch: the error file {path} could not be written: {problem}", file=sys.stderr)


# The unrecoverable error that is ending this process, once the excepthook has seen it.
_ENDING: list[BaseException] = []


def _exit_unrecoverable() -> None:
    """At the interpreter's exit (atexit, registered before any other of the package's, so
    run after them): the exit code no launcher retries, in place of Python's 1."""
    if not _ENDING:
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(EXIT_UNRECOVERABLE)


def install_excepthook() -> None:
    """An uncaught unrecoverable error ends the worker with ``EXIT_UNRECOVERABLE``: the hook
    writes the error file and lets the hooks before it print the error (torch's own hook
    prints through a buffer); the exit code is set at the interpreter's exit. Any other error
    goes to those hooks alone."""
    previous = sys.excepthook
    if getattr(previous, "_trainctl", False):
        return

    def hook(kind: Any, value: BaseException, tb: Any) -> None:
        if unrecoverable(value):
            _ENDING.append(value)
            record(value, tb)
        previous(kind, value, tb)

    hook._trainctl = True  # type: ignore[attr-defined]
    sys.excepthook = hook
    atexit.register(_exit_unrecoverable)
