"""The group's membership over time: a group's start (the first, or a round's), the state made
the same on every rank (``_sync``), the regroup (leave the group, wait for the next round, join
it), and the ways out of it (leave, stop). Functions of the job (``Elastic``) whose state they
change; what the worker does at each turn is ``trainctl.regroup``'s (the protocol's tables,
shared with the built-in trainer).

A group's start is the same collectives for a worker that has just started and one that
regroups (``init_process_group``, ``_sync``, the DDP wrapper's own), so both can be in the
same new group. ``_sync`` makes every rank's state the same: the lowest rank of those furthest
on streams model, optimizer, scheduler, GradScaler, position and user state to the others; when
every rank holds the same step nothing travels; at a job's start rank 0's fresh or resumed
state goes to all.
"""

from __future__ import annotations

import os
import sys
import time
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from .. import control as ctl
from .. import regroup as protocol
from . import _check, _state
from ._group import say, why

if TYPE_CHECKING:
    from ._elastic import Elastic

# contract::exit: a worker that stopped or left at a step boundary, and one that lost a peer
# and could not go on in place.
EXIT_PREEMPTED = 143
EXIT_PEER_LOST = 75

# contract::env::WARM_START: a worker started before its node had a place in the job.
WARM_WORKER = "TRAINCTL_WARM_WORKER"

# What a worker waiting for its next round does when it does not join.
_STOP = object()
_LEAVE = object()


def start_group(job: Elastic) -> dict[str, Any]:
    """Joins the group the environment names (the job's first, or a round's), makes every
    rank's state the same and wraps the model."""
    job.group.begin()
    job.rank, job.world_size = job.group.init()
    # The node's place in this round (the straggler watch's slots name it).
    job._node = int(os.environ.get("GROUP_RANK", "0"))
    synced = _sync(job)
    device_ids = [job.device.index] if job.backend == "nccl" else None
    job._ddp = DistributedDataParallel(job.module, device_ids=device_ids, **job.ddp_options)
    job._ddp.register_comm_hook(None, job._comm_hook)
    job.group.established()
    job._generation += 1
    job._first_start = False
    return synced


def first_start(job: Elastic) -> dict[str, Any]:
    """The job's first group. Its round can end while it starts (a node arrives just as this
    worker said it regroups in place, and the agent hands it the next round): the start then
    fails as a regroup's failed start does, and the worker waits for the next round the same
    way. Without an agent, or for any other error, the error stands."""
    started = time.monotonic()
    try:
        return start_group(job)
    except Exception as e:  # noqa: BLE001 - sorted below
        if job.control is None or job.group.failure(e, time.monotonic() - started) is protocol.Failure.OTHER:
            raise
        say(f"rank {os.environ.get('RANK')}: the first group's round ended as it started ({why(e)}); waiting for the next round")
        return regroup(job, f"the first group's start: {why(e)}", saver=False, lost=True)


def warm_start(job: Elastic) -> dict[str, Any]:
    """The first group of a worker started warm: its start (the program up to ``Elastic``) ran
    before its node had a place in the job, and said it is ready (the constructor did); it waits
    here for the round the agent hands it, as a regrouping worker does, without leaving a group
    first, and takes the state from a peer there. The others paused only for that."""
    if job.control is None:
        raise RuntimeError(
            f"{WARM_WORKER} is set but the agent's control channel cannot be used: this worker "
            "cannot be handed its place in the job"
        )
    return regroup(job, "its node joins, its workers warm", saver=False, lost=False, warm=True)


def _sync(job: Elastic) -> dict[str, Any]:
    """Every rank's state made the same (see the module's doc); the ranks at the furthest
    step are checked to hold the same state before anything travels."""
    if job.live:
        job._fingerprint()
    mine = [job.progress["global_step"] + 1, _check.state_hash(_check.counters(job))] if job.live else [0, 0]
    t = torch.tensor(mine, dtype=torch.int64, device=job.device)
    out = [torch.zeros_like(t) for _ in range(job.world_size)]
    dist.all_gather(out, t)
    held = [int(x[0].item()) for x in out]
    hashes = [int(x[1].item()) for x in out]
    furthest = max(held)
    _check.compare(
        job,
        [h if held[r] == furthest else 0 for r, h in enumerate(hashes)],
        f"as the group of world size {job.world_size} started, at step {max(furthest - 1, 0)}",
    )
    result = {
        "resumed": False,
        "received": False,
        "bytes": 0,
        "fresh": furthest > 0 and min(held) == 0,
        "came_in": False,
    }
    if furthest > 0 and all(h == furthest for h in held):
        job.live = True
        _resized(job)
        return result
    source = held.index(furthest) if furthest > 0 else 0
    resumed = False
    if furthest == 0 and job.rank == 0:
        resumed = _state.read_checkpoint(job)
    if held[job.rank] != furthest:
        job.live = False
    nbytes, resumed = _state.broadcast(job, source, resumed)
    job.live = True
    job._fingerprint()
    from_peer = furthest > 0
    # A process that starts the loop from its top in a state taken mid-loop (see Flow). A
    # survivor one step behind, which takes the furthest's state in a regroup, is at the
    # others' place in the loop already.
    came_in = job._first_start and (
        (from_peer and held[job.rank] != furthest) or (resumed and job.progress["position"] > 0)
    )
    if came_in:
        job._flow.came_in(job.progress["position"] >= job.dataset_size, max(job.progress["epoch_end_evals"], 0))
    _resized(job)
    result.update(
        resumed=resumed,
        received=from_peer and held[job.rank] != furthest,
        bytes=nbytes if from_peer else 0,
        came_in=came_in,
    )
    return result


def _resized(job: Elastic) -> None:
    """Tells ``on_resize`` when the state was trained at another world size."""
    p = job.progress
    old, new = p["world_size"], job.world_size
    p["world_size"] = new
    if old and old != new and job.on_resize is not None:
        job.on_resize(old, new)


def teardown(job: Elastic) -> None:
    def drop_wrapper() -> None:
        job._ddp = None

    job.group.teardown(drop_wrapper)


def regroup(
    job: Elastic, reason: str, saver: bool, lost: bool, detail: str = "", warm: bool = False
) -> dict[str, Any]:
    """Leaves the group and goes on in the next round's, with every rank's state the same.
    Joining can fail (another node lost meanwhile): the worker says so and waits for the
    round after. `reason` is in trainctl's words; `detail`, PyTorch's own text of the error,
    goes to the records. `warm`: a warm worker's first group (it has none to leave, and tells
    the agent nothing before its round)."""
    if job.control is None:
        raise RuntimeError(f"{reason}: the group cannot change without trainctl run's agent")
    left = time.monotonic()
    world_size_before = job.world_size
    step_left = job.progress["global_step"]
    teardown(job)
    cause = reason
    if lost:
        reason = f"peer lost: {reason}"
    while True:
        nxt = _next_round(job, cause, lost, tell=not warm)
        warm = False
        if nxt is _LEAVE:
            leave(job)
        if nxt is _STOP:
            if saver:
                job._checkpoint(force=True)
            say(f"rank {job.rank} stopped (SIGTERM) while waiting for the next round")
            sys.exit(EXIT_PREEMPTED)
        assert isinstance(nxt, list)
        os.environ.update(dict(nxt))
        saver = os.environ.get("RANK") == "0"
        started = time.monotonic()
        try:
            synced = start_group(job)
            break
        except Exception as e:  # noqa: BLE001 - a collective of the new group failed
            if job.group.failure(e, time.monotonic() - started) is protocol.Failure.OTHER:
                raise
            say(f"rank {os.environ.get('RANK')}: the new group failed ({why(e)}); waiting for the next round")
            teardown(job)
            cause, lost = f"joining the new group: {why(e)}", True
    _report_regroup(job, reason, world_size_before, step_left, synced, time.monotonic() - left, detail)
    if synced["fresh"] and not synced["came_in"]:
        # A newcomer runs the loop from its top: the evaluations it cannot be part of are
        # skipped here too (see Flow).
        job._flow.newcomer_arrived(job.progress["position"] >= job.dataset_size)
    return synced


def _report_regroup(
    job: Elastic,
    reason: str,
    world_size_before: int,
    step_left: int,
    synced: dict[str, Any],
    seconds: float,
    detail: str = "",
) -> None:
    p = job.progress
    regrouped = {
        "world_size_before": world_size_before,
        "world_size": job.world_size,
        "rank": job.rank,
        "step": p["global_step"],
        "steps_dropped": max(step_left - p["global_step"], 0),
        "bytes": synced["bytes"],
        "received": synced["received"],
        "seconds": seconds,
    }
    # In the file of this worker's rank in the new group.
    extra = {"detail": detail} if detail else {}
    job._records.write(job.rank, "regroup", reason=reason, **regrouped, **extra)
    assert job.control is not None
    try:
        job.control.send(
            ctl.regrouped(
                regrouped["world_size_before"],
                regrouped["world_size"],
                regrouped["rank"],
                regrouped["step"],
                regrouped["steps_dropped"],
                regrouped["bytes"],
                regrouped["seconds"],
                regrouped["received"],
                job._assignments,
            )
        )
    except ctl.ControlError:
        # The agent's report of the regroup; training goes on without it.
        pass


def _next_round(job: Elastic, why: str, lost: bool, tell: bool = True) -> Any:
    """Tells the agent why this worker left its group (unless not `tell`: a warm worker has
    none), then waits for the next round's environment, a stop, or the word that this node
    goes. A closed channel: the agent restarts this node's workers, so this one exits as a
    lost peer's would."""
    assert job.control is not None
    step = job.progress["global_step"]
    try:
        if tell and lost:
            job.control.send(ctl.lost(job._assignments, step, why))
        elif tell:
            job.control.send(ctl.paused(job._assignments, step))
        assigned, job._assigned = job._assigned, None
        wait = 0.0
        while True:
            message = job.control.recv(wait)
            if message is not None:
                if isinstance(message, ctl.Assign):
                    assigned = message.env
                    job._assignments += 1
                else:
                    job._take(message)
                # Whatever else has come, before deciding.
                wait = 0.0
                continue
            # An assignment in hand is joined even when a stop came too: the stop then rides
            # the new group's first step, and every rank stops together.
            decision = protocol.waiting(job._leaving, assigned is not None, job.stop_requested)
            if decision is protocol.Waiting.LEAVE:
                return _LEAVE
            if decision is protocol.Waiting.JOIN:
                return assigned
            if decision is protocol.Waiting.STOP:
                return _STOP
            wait = 0.1
    except ctl.ControlError as e:
        say(f"{why}; the agent did not regroup this worker ({e})")
        sys.exit(EXIT_PEER_LOST)


def leave(job: Elastic) -> None:
    if job._first_start:
        say(f"local rank {os.environ.get('LOCAL_RANK', '0')} leaves: its node goes before it had a place in the job")
    else:
        say(f"rank {job.rank} leaves the job after step {job.progress['global_step']}: its node was asked to go")
    teardown(job)
    sys.exit(EXIT_PREEMPTED)


def stop(job: Elastic, saver: int) -> None:
    # The rank that saves: rank 0, or the lowest that stays when rank 0's node goes.
    if job.rank == saver:
        job._checkpoint(force=True)
    try:
        dist.barrier()
    except Exception:  # noqa: BLE001 - the checkpoint is written; a peer gone changes nothing
        pass
    say(f"rank {job.rank} stopped after step {job.progress['global_step']} (SIGTERM); the checkpoint holds it")
    teardown(job)
    sys.exit(EXIT_PREEMPTED)
