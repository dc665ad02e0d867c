"""How a job's process ends: a loop that ends by an exception still tears the group down (a
process that exits with gloo's threads running aborts, hiding the exception's exit code), and
a collective that lost a peer outside the job's steps says where collectives go."""

from __future__ import annotations

import atexit
import sys
from typing import Any, Callable

from .. import regroup
from ._group import Group, say
from ._inbox import Inbox


class Exits:
    """The job's excepthook and exit hook, installed while it trains."""

    def __init__(self, group: Group, inbox: Inbox, teardown: Callable[[], None]):
        self.group = group
        self.inbox = inbox
        self.teardown = teardown
        self._previous = sys.excepthook

    def install(self) -> None:
        self._previous = sys.excepthook
        sys.excepthook = self._on_uncaught
        atexit.register(self._at_exit)

    def uninstall(self) -> None:
        sys.excepthook = self._previous
        atexit.unregister(self._at_exit)

    def _on_uncaught(self, kind: Any, value: BaseException, tb: Any) -> None:
        self._previous(kind, value, tb)
        if (
            self.inbox.attached
            and isinstance(value, Exception)
            and self.group.failure(value, 0.0) is not regroup.Failure.OTHER
        ):
            say(
                "a collective outside `with job.step():` and job.evaluate() lost a peer, and the job "
                "cannot go on from there: run the loop's collectives (an evaluation's all_reduce) "
                "inside job.evaluate(fn), which regroups and runs fn again"
            )

    def _at_exit(self) -> None:
        try:
            self.teardown()
        except Exception:  # noqa: BLE001 - the process ends either way
            pass
