"""The group's membership over time: a group's start (the first, a warm one, or a round's),
the state made the same on every rank (``_sync``), the regroup (leave the group, wait for the
next round, join it), and the ways out of it (leave, stop). What the worker does at each turn
is ``trainctl.regroup``'s, the protocol's tables, shared with the built-in trainer.

A group's start is the same collectives for a worker that has just started and one that
regroups (``init_process_group``, ``_sync``, the DDP wrapper's own), so both can be in the
same new group. ``_sync`` makes every rank's state the same: the lowest rank of those furthest
on streams model, optimizer, scheduler, GradScaler, position and ``state=`` objects to the
others; when every rank holds the same step nothing travels; at a job's start rank 0's fresh
or resumed state goes to all.

It knows the job's parts, not the job: the group, the agent's inbox, the training state, the
flow of the loop's calls, the records, and the few things the façade does for it (wrap the
model, save).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from .. import control as ctl
from .. import regroup as protocol
from . import _check
from ._flow import Flow
from ._group import Group, say, why
from ._inbox import Inbox, Leave, Stop
from ._records import Records
from ._state import TrainingState

# contract::exit: a worker that stopped or left at a step boundary.
EXIT_PREEMPTED = 143
# contract::env::WARM_START: a worker started before its node had a place in the job.
WARM_WORKER = "TRAINCTL_WARM_WORKER"


@dataclass
class Place:
    """This worker's place in the job now."""

    rank: int
    world_size: int
    node: int
    """Its node's rank in the round (the straggler watch's slots name it)."""
    generation: int = 0
    """Groups started so far (a regroup makes the epoch's plan stale)."""
    first_start: bool = True
    """Until this process's first group has started (see ``_sync``'s `came_in`)."""


@dataclass(frozen=True)
class Synced:
    """How a group's ranks came to hold the same state."""

    resumed: bool = False
    """Rank 0 read the checkpoint (no rank held a live state)."""
    received: bool = False
    """This rank took a peer's state."""
    bytes: int = 0
    fresh: bool = False
    """A rank of the group came in with no state (a newcomer)."""
    came_in: bool = False
    """This rank came in: it starts the loop from its top in a state taken mid-loop."""


@dataclass(frozen=True)
class Hooks:
    """What the façade does for the membership."""

    wrap: Callable[[], None]
    """Wraps the model in DDP over the group just started (its comm hook the agreement's)."""
    unwrap: Callable[[], None]
    """Lets go of the DDP wrapper (before the group's teardown)."""
    save: Callable[[bool], None]
    """Writes the checkpoint (``if_newer``: see ``TrainingState.write_checkpoint``)."""
    stopped: Callable[[], bool]
    """A stop (SIGTERM) was asked for."""
    on_resize: Callable[[int, int], None] | None


class Membership:
    """See the module's doc."""

    def __init__(
        self,
        group: Group,
        inbox: Inbox,
        state: TrainingState,
        flow: Flow,
        records: Records,
        place: Place,
        hooks: Hooks,
        device: torch.device,
        dataset_size: int,
        checkpoint_path: str,
    ):
        self.group = group
        self.inbox = inbox
        self.state = state
        self.flow = flow
        self.records = records
        self.place = place
        self.hooks = hooks
        self.device = device
        self.dataset_size = dataset_size
        self.checkpoint_path = checkpoint_path

    # --- starts ---------------------------------------------------------------------------------

    def start_group(self) -> Synced:
        """Joins the group the environment names (the job's first, or a round's), makes every
        rank's state the same and wraps the model."""
        self.group.begin()
        self.place.rank, self.place.world_size = self.group.init()
        self.place.node = int(os.environ.get("GROUP_RANK", "0"))
        synced = self._sync()
        self.hooks.wrap()
        self.group.established()
        self.place.generation += 1
        self.place.first_start = False
        return synced

    def first_start(self) -> Synced:
        """The job's first group. Its round can end while it starts (a node arrives just as this
        worker said it regroups in place, and the agent hands it the next round): the start then
        fails as a regroup's failed start does (``regroup.after_start_failure``), and the worker
        waits for the next round the same way."""
        started = time.monotonic()
        try:
            return self.start_group()
        except Exception as e:  # noqa: BLE001 - sorted below
            failure = self.group.failure(e, time.monotonic() - started)
            if protocol.after_start_failure(failure, self.inbox.attached) is not protocol.Do.REGROUP:
                raise
            say(
                f"rank {os.environ.get('RANK')}: the first group's round ended as it started ({why(e)}); "
                "waiting for the next round"
            )
            return self.regroup(f"the first group's start: {why(e)}", lost=True)

    def warm_start(self) -> Synced:
        """The first group of a worker started warm: its start (the program up to ``Elastic``) ran
        before its node had a place in the job, and said it is ready; it waits here for the round
        the agent hands it, as a regrouping worker does, without leaving a group first, and takes
        the state from a peer there. The others paused only for that."""
        if not self.inbox.attached:
            raise RuntimeError(
                f"{WARM_WORKER} is set but the agent's control channel cannot be used: this worker "
                "cannot be handed its place in the job"
            )
        return self.regroup("its node joins, its workers warm", lost=False, warm=True)

    # --- the state made the same ----------------------------------------------------------------

    def _sync(self) -> Synced:
        """Every rank's state made the same (see the module's doc); the ranks at the furthest
        step are checked to hold the same state before anything travels."""
        state, place = self.state, self.place
        if state.live:
            state.fingerprint()
        mine = [state.progress.global_step + 1, state.state_hash()] if state.live else [0, 0]
        t = torch.tensor(mine, dtype=torch.int64, device=self.device)
        out = [torch.zeros_like(t) for _ in range(place.world_size)]
        dist.all_gather(out, t)
        held = [int(x[0].item()) for x in out]
        hashes = [int(x[1].item()) for x in out]
        furthest = max(held)
        _check.compare(
            [h if held[r] == furthest else 0 for r, h in enumerate(hashes)],
            f"as the group of world size {place.world_size} started, at step {max(furthest - 1, 0)}",
            place.rank,
            state.counters,
        )
        fresh = furthest > 0 and min(held) == 0
        if furthest > 0 and all(h == furthest for h in held):
            state.live = True
            self._resized()
            return Synced(fresh=fresh)
        source = held.index(furthest) if furthest > 0 else 0
        resumed = False
        if furthest == 0 and place.rank == 0:
            resumed = state.read_checkpoint(self.checkpoint_path)
        if held[place.rank] != furthest:
            state.live = False
        nbytes, resumed = state.broadcast(source, place.rank, self.device, resumed)
        state.live = True
        state.fingerprint()
        from_peer = furthest > 0
        received = from_peer and held[place.rank] != furthest
        # A process that starts the loop from its top in a state taken mid-loop (see Flow). A
        # survivor one step behind, which takes the furthest's state in a regroup, is at the
        # others' place in the loop already.
        came_in = place.first_start and (received or (resumed and state.progress.position > 0))
        if came_in:
            p = state.progress
            self.flow.came_in(p.position >= self.dataset_size, max(p.epoch_end_evals, 0))
        self._resized()
        return Synced(resumed, received, nbytes if from_peer else 0, fresh, came_in)

    def _resized(self) -> None:
        """Tells ``on_resize`` when the state was trained at another world size."""
        p = self.state.progress
        old, new = p.world_size, self.place.world_size
        p.world_size = new
        if old and old != new and self.hooks.on_resize is not None:
            self.hooks.on_resize(old, new)

    # --- the regroup ----------------------------------------------------------------------------

    def teardown(self) -> None:
        self.group.teardown(self.hooks.unwrap)

    def regroup(self, reason: str, lost: bool, detail: str = "", saver: bool = False, warm: bool = False) -> Synced:
        """Leaves the group and goes on in the next round's, with every rank's state the same.
        Joining can fail (another node lost meanwhile): the worker says so and waits for the
        round after. `reason` is in trainctl's words; `detail`, PyTorch's own text of the error,
        goes to the records. `saver`: this rank saves if a stop comes while it waits (after a
        pause, the rank the step's agreement named; after a lost peer, see
        ``regroup.saver_while_waiting``). `warm`: a warm worker's first group (it has none to
        leave, and tells the agent nothing before its round)."""
        if not self.inbox.attached:
            raise RuntimeError(f"{reason}: the group cannot change without trainctl run's agent")
        place, p = self.place, self.state.progress
        left = time.monotonic()
        world_size_before, step_left = place.world_size, p.global_step
        self.teardown()
        cause, said = reason, f"peer lost: {reason}" if lost else reason
        save = protocol.saver_while_waiting(lost, saver, self.state.live)
        while True:
            nxt = self.inbox.wait_for_round(cause, lost, p.global_step, self.hooks.stopped, tell=not warm)
            warm = False
            if isinstance(nxt, Leave):
                self.leave()
            if isinstance(nxt, Stop):
                if save is not protocol.Save.NO:
                    self.hooks.save(save is protocol.Save.IF_NEWER)
                say(f"rank {place.rank} stopped (SIGTERM) while waiting for the next round")
                sys.exit(EXIT_PREEMPTED)
            assert isinstance(nxt, list)
            os.environ.update(dict(nxt))
            started = time.monotonic()
            try:
                synced = self.start_group()
                break
            except Exception as e:  # noqa: BLE001 - a collective of the new group failed
                failure = self.group.failure(e, time.monotonic() - started)
                if protocol.after_start_failure(failure, True) is not protocol.Do.REGROUP:
                    raise
                say(f"rank {os.environ.get('RANK')}: the new group failed ({why(e)}); waiting for the next round")
                self.teardown()
                cause, lost = f"joining the new group: {why(e)}", True
                save = protocol.saver_while_waiting(True, False, self.state.live)
        self._report(said, world_size_before, step_left, synced, time.monotonic() - left, detail)
        if synced.fresh and not synced.came_in:
            # A newcomer runs the loop from its top: the evaluations it cannot be part of are
            # skipped here too (see Flow).
            self.flow.newcomer_arrived(p.position >= self.dataset_size)
        return synced

    def _report(
        self, reason: str, world_size_before: int, step_left: int, synced: Synced, seconds: float, detail: str
    ) -> None:
        place, p = self.place, self.state.progress
        dropped = max(step_left - p.global_step, 0)
        # In the file of this worker's rank in the new group.
        extra = {"detail": detail} if detail else {}
        self.records.write(
            place.rank,
            "regroup",
            reason=reason,
            world_size_before=world_size_before,
            world_size=place.world_size,
            rank=place.rank,
            step=p.global_step,
            steps_dropped=dropped,
            bytes=synced.bytes,
            received=synced.received,
            seconds=seconds,
            **extra,
        )
        self.inbox.send(
            ctl.regrouped(
                world_size_before,
                place.world_size,
                place.rank,
                p.global_step,
                dropped,
                synced.bytes,
                seconds,
                synced.received,
                self.inbox.assignments,
            )
        )

    # --- the ways out ---------------------------------------------------------------------------

    def leave(self) -> None:
        if self.place.first_start:
            say(f"local rank {os.environ.get('LOCAL_RANK', '0')} leaves: its node goes before it had a place in the job")
        else:
            p = self.state.progress
            say(f"rank {self.place.rank} leaves the job after step {p.global_step}: its node was asked to go")
        self.teardown()
        sys.exit(EXIT_PREEMPTED)

    def stop(self, saver: int) -> None:
        # The rank that saves: rank 0, or the lowest that stays when rank 0's node goes.
        if self.place.rank == saver:
            self.hooks.save(False)
        try:
            dist.barrier()
        except Exception:  # noqa: BLE001 - the checkpoint is written; a peer gone changes nothing
            pass
        say(f"rank {self.place.rank} stopped after step {self.state.progress.global_step} (SIGTERM); the checkpoint holds it")
        self.teardown()
        sys.exit(EXIT_PREEMPTED)
