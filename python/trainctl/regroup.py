"""The worker's side of the elastic protocol, as pure decisions: what a rank raises at a step,
what it does once every rank agreed the step, when a collective fails, when a group's start
fails, while it waits for the next round (and who saves if a stop comes then), and when a
checkpoint is due. No other place decides these. The built-in trainer follows the same tables
(``crates/collective/src/regroup.rs``); their cases are data, ``vectors/regroup.json`` at the
repository's root, which both languages' tests check (``python/tests/test_vectors.py`` here,
under a plain Python too: this module needs no torch).

Invariants (shown case by case in the vectors): every rank ends a step in the same decision; a
stop wins over a pause, a pause over a scheduled checkpoint; exactly one rank saves on a stop
at a step or after a pause (rank 0, or the lowest that stays when rank 0's node leaves), and
after a lost peer (rank 0, maybe) every survivor writes if its step is newer than the file's;
a state a stream cut off half-way is never saved; a worker waiting for a round leaves before it
joins, and joins before it stops.
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


class Save(str, Enum):
    """Whether a worker saves the checkpoint when a stop comes while it waits for a round."""

    YES = "yes"
    NO = "no"
    IF_NEWER = "if_newer"
    """When the checkpoint holds an earlier step: several ranks may each hold the job's state
    and none knows it is the lowest one left, so each writes, and the furthest wins."""


def saver_while_waiting(lost: bool, saver: bool, live: bool) -> Save:
    """A worker waits for the next round and a stop comes: ``lost`` after a lost peer or a
    failed group start (else after a pause), ``saver`` whether the pause's agreement named it
    (``after_step``), ``live`` whether its state is one it trained or took whole (not what a
    stream cut off half-way left). After a lost peer the saver is unknown: the lost rank may
    be rank 0, and no survivor knows whether it is the lowest one left, so every survivor
    saves if its step is newer than the checkpoint's."""
    if not live:
        return Save.NO
    if lost:
        return Save.IF_NEWER
    return Save.YES if saver else Save.NO


def after_start_failure(failure: Failure, agent: bool) -> Do:
    """A group's start failed (the first, a warm one, or a round's): the worker waits for the
    next round (``REGROUP``) when the group failed (a peer lost or silent) and an agent
    regroups it; otherwise (its own error, or no agent) it fails."""
    if agent and failure in (Failure.PEER_LOST, Failure.TIMED_OUT):
        return Do.REGROUP
    return Do.FAIL


def checkpoint_due(global_step: int, every: int, epoch_ends: bool) -> bool:
    """Whether the step just applied (global step ``global_step``) checkpoints on schedule:
    every ``every`` global steps (0: never), counted from the run's start so that a regroup or a
    resume never moves the schedule; not at the epoch's last step, whose end checkpoints
    anyway."""
    return every > 0 and global_step % every == 0 and not epoch_ends
