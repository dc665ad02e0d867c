"""The worker's side of the elastic protocol, as pure decisions: what a rank raises at a step,
what it does once every rank agreed the step, when a collective fails, and while it waits for
the next round. The built-in trainer follows the same tables (``crates/collective/src/
regroup.rs``); their cases are data, ``vectors/regroup.json`` at the repository's root, which
both languages' tests check (``python/tests/test_vectors.py`` here).

Invariants (shown case by case in the vectors): every rank ends a step in the same decision; a
stop wins over a pause, a pause over a scheduled checkpoint; exactly one rank saves on a stop
or a regroup (rank 0, or the lowest that stays when rank 0's node leaves); a worker waiting for
a round leaves before it joins, and joins before it stops.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


@dataclass(frozen=True)
class Raised:
    """What one rank raises at a step; each is raised for all when any rank raises it."""

    stop: bool = False
    pause: bool = False
    leave: bool = False
    rank0_leaves: bool = False


def raised(stop: bool, assigned: bool, leaving: bool, rank: int) -> Raised:
    """The flags rank ``rank`` raises: a stop asked for, the next round handed (``assigned``),
    its node asked to go (``leaving``)."""
    return Raised(stop=stop, pause=assigned or leaving, leave=leaving, rank0_leaves=leaving and rank == 0)


@dataclass(frozen=True)
class Agreed:
    """A step's flags summed over the ranks: how many ranks raised each."""

    stop: int = 0
    pause: int = 0
    leave: int = 0
    rank0_leaves: int = 0


class Do(str, Enum):
    """What a worker does after a step (``AfterStep.do``) or a failed collective."""

    CONTINUE = "continue"
    CHECKPOINT = "checkpoint"
    STOP = "stop"
    LEAVE = "leave"
    REGROUP = "regroup"
    FAIL = "fail"


@dataclass(frozen=True)
class AfterStep:
    """``do``, with ``saver`` (the rank that checkpoints) for a stop or a regroup."""

    do: Do
    saver: int = 0


def after_step(agreed: Agreed, me_leaving: bool, checkpoint_due: bool) -> AfterStep:
    """After a step whose flags summed to ``agreed``: ``me_leaving`` is whether this rank's own
    node goes, ``checkpoint_due`` whether the schedule wants a checkpoint here."""
    if agreed.stop > 0:
        # Every rank stops at this step, rank 0 among them, whoever leaves.
        return AfterStep(Do.STOP, 0)
    if agreed.pause > 0:
        if me_leaving:
            return AfterStep(Do.LEAVE)
        return AfterStep(Do.REGROUP, _saver(agreed))
    if checkpoint_due:
        return AfterStep(Do.CHECKPOINT)
    return AfterStep(Do.CONTINUE)


def _saver(agreed: Agreed) -> int:
    """Rank 0, or the lowest rank that stays when rank 0's node leaves (its ranks are
    consecutive from 0, ``agreed.leave`` of them)."""
    return agreed.leave if agreed.rank0_leaves > 0 else 0


class Failure(str, Enum):
    """How a collective failed, as the worker itself knows it (never from an error's wording)."""

    PEER_LOST = "peer_lost"
    TIMED_OUT = "timed_out"
    OTHER = "other"


@dataclass(frozen=True)
class AfterFailure:
    """``REGROUP`` (the step dropped, wait for the next round) or ``FAIL``; ``save`` when rank 0
    first saves the last step every rank completed."""

    do: Do
    save: bool = False


def after_failure(failure: Failure, agent: bool, rank: int) -> AfterFailure:
    """A collective of the step failed: ``agent`` is whether an agent regroups this worker."""
    if failure in (Failure.PEER_LOST, Failure.TIMED_OUT) and agent:
        return AfterFailure(Do.REGROUP)
    if failure is Failure.PEER_LOST:
        return AfterFailure(Do.FAIL, save=rank == 0)
    return AfterFailure(Do.FAIL)


class Waiting(str, Enum):
    """What a worker waiting for its next round does."""

    LEAVE = "leave"
    JOIN = "join"
    STOP = "stop"
    WAIT = "wait"


def waiting(leaving: bool, assigned: bool, stop: bool) -> Waiting:
    """As of the messages read so far: its node asked to go, a round handed, a SIGTERM."""
    if leaving:
        return Waiting.LEAVE
    if assigned:
        return Waiting.JOIN
    if stop:
        return Waiting.STOP
    return Waiting.WAIT
