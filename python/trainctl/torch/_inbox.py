"""The agent's end of things, as this worker sees it: the control channel, the messages that
came while it trained (the next round, its node's leave), and the wait for a round.

With no channel (no ``trainctl run``, or one that cannot be used) the inbox is detached: the
worker is a torchrun worker, restarted when its group changes.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable, Union

from .. import control as ctl
from .. import regroup as protocol
from ._group import say

# contract::exit::PEER_LOST: a worker that lost a peer and could not go on in place.
EXIT_PEER_LOST = 75

Env = list[tuple[str, str]]


@dataclass(frozen=True)
class Leave:
    """While it waited, this worker's node was asked to go."""


@dataclass(frozen=True)
class Stop:
    """While it waited, a stop (SIGTERM) came and no round."""


Waited = Union[Env, Leave, Stop]


class Inbox:
    """See the module's doc."""

    def __init__(self, channel: ctl.Channel | None):
        self.channel = channel
        # The next round, handed while the worker trained (taken at the step all ranks pause
        # at), and how many rounds it was handed in all.
        self.assigned: Env | None = None
        self.assignments = 0
        # Which of them made the group this worker is in or starting (0: its first): a loss is
        # reported as that group's, so that one in a group the worker is already leaving for an
        # assignment in hand is stale to the agent.
        self.joined = 0
        # Its node was asked to go.
        self.leaving = False

    @classmethod
    def open(cls, launched: bool, on_message: Callable[[object], None]) -> Inbox:
        """The channel the launcher passed (TRAINCTL_CONTROL_FD), told this worker regroups in
        place; detached without one, or when it cannot be used (which is said)."""
        if not launched:
            return cls(None)
        try:
            channel = ctl.Channel.from_env(on_message=on_message)
            if channel is not None:
                channel.send(ctl.ready())
            return cls(channel)
        except ctl.ControlError as e:
            say(f"the agent's control channel cannot be used: {e}; a change of group restarts this worker")
            return cls(None)

    @property
    def attached(self) -> bool:
        return self.channel is not None

    def drain(self) -> None:
        """The messages that came while the worker trained."""
        if self.channel is None:
            return
        while True:
            try:
                message = self.channel.recv(0)
            except ctl.ControlError:
                # A broken channel shows when the worker next needs it.
                return
            if message is None:
                return
            self._take(message)

    def _take(self, message: object) -> None:
        if isinstance(message, ctl.Assign):
            self.assigned = message.env
            self.assignments += 1
        elif isinstance(message, ctl.Leave):
            self.leaving = True

    def wait_for_round(
        self, why: str, lost: bool, step: int, stopped: Callable[[], bool], tell: bool = True
    ) -> Waited:
        """Tells the agent why this worker left its group at global step ``step`` (``lost``: a
        collective failed; else it paused for an assignment; nothing when not ``tell``: a warm
        worker had no group), then waits for the next round's environment, a stop, or the word
        that this node goes (``regroup.waiting`` decides). A channel that breaks: the agent
        restarts this node's workers, so this one exits as a lost peer's would."""
        assert self.channel is not None
        try:
            if tell and lost:
                self.channel.send(ctl.lost(self.joined, step, why))
            elif tell:
                self.channel.send(ctl.paused(self.assignments, step))
            assigned, self.assigned = self.assigned, None
            wait = 0.0
            while True:
                message = self.channel.recv(wait)
                if message is not None:
                    if isinstance(message, ctl.Assign):
                        assigned = message.env
                        self.assignments += 1
                    else:
                        self._take(message)
                    # Whatever else has come, before deciding.
                    wait = 0.0
                    continue
                # An assignment in hand is joined even when a stop came too: the stop then
                # rides the new group's first step, and every rank stops together.
                decision = protocol.waiting(self.leaving, assigned is not None, stopped())
                if decision is protocol.Waiting.LEAVE:
                    return Leave()
                if decision is protocol.Waiting.JOIN:
                    assert assigned is not None
                    self.joined = self.assignments
                    return assigned
                if decision is protocol.Waiting.STOP:
                    return Stop()
                wait = 0.1
        except ctl.ControlError as e:
            say(f"{why}; the agent did not regroup this worker ({e})")
            sys.exit(EXIT_PEER_LOST)

    def send(self, message: bytes) -> None:
        """A report for the agent (a regroup's cost, a straggler, the training's end); the
        worker goes on without it when the channel is broken."""
        if self.channel is None:
            return
        try:
            self.channel.send(message)
        except ctl.ControlError:
            pass

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()
