"""One ``with job.step():`` block, and what the job does around it: the micro-batch handed to
the loop, this rank's part of the step's agreement, the agreement read at the block's end, the
update applied only then, a lost peer's step dropped (the workers regroup in place), and the
step's record. ``Elastic`` hands the loop a ``Step`` and carries out at its boundaries what
the agreement decided (``pending``).

A step is applied on a rank only once every rank agreed it is whole, so after a peer is lost
the survivors hold the same step or one step apart, and the furthest streams.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable

import torch
from torch.nn.parallel import DistributedDataParallel

from .. import control as ctl
from .. import regroup, stragglers
from ..sampler import MASK
from . import _check, _data, _guards
from ._agreement import Agreement, Outcome, flags
from ._errors import DivergedError, UsageError
from ._flow import Flow
from ._group import Group, detail, say, why
from ._inbox import Inbox
from ._kept import Kept
from ._membership import Membership, Place
from ._records import Done, Records, Shape
from ._state import TrainingState


class Step:
    """One ``with job.step() as step:`` block: one micro-batch. Set ``step.loss`` (and
    ``step.correct``, the right predictions of this rank's batch) for the records and the loss
    lines. ``step.sync`` is True on the micro-batch whose end applies the update (always, unless
    ``accumulate`` > 1), ``step.first`` on its step's first one. After the block, ``step.applied`` says whether it applied the update:
    code that changes state after an update (an EMA of your own, a counter) runs only ``if
    step.applied:``."""

    def __init__(self, stepper: Stepper):
        self._stepper = stepper
        self.loss: Any = None
        self.correct: Any = None
        self.sync = True
        self.first = True
        # When its step's first micro-batch began, and how long the loop took to bring it.
        self.started = 0.0
        self.data_s = 0.0
        self._applied: bool | None = None

    @property
    def applied(self) -> bool:
        """After the block: True when it applied the optimizer's update; False after a
        micro-batch before its step's last, and after a step dropped because a peer was lost
        (the rank may then hold a peer's state that did apply it, with the loop's code after
        it: running that code again would apply it twice)."""
        if self._applied is None:
            raise UsageError(
                "step.applied was read inside `with job.step():`: the update is applied (or not) "
                "at the block's end, so read it after the block"
            )
        return self._applied

    def __enter__(self) -> Step:
        self._stepper.enter(self)
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        return self._stepper.exit(self, exc)


class Stepper:
    """The job's side of every ``with job.step():`` (see the module's doc)."""

    def __init__(
        self,
        state: TrainingState,
        place: Place,
        group: Group,
        inbox: Inbox,
        membership: Membership,
        flow: Flow,
        records: Records,
        shape: Shape,
        device: torch.device,
        ddp_options: dict[str, Any],
        checkpoint_every: int,
        watch: stragglers.Watch | None,
        save: Callable[[], None],
        stopped: Callable[[], bool],
    ):
        self.state, self.place, self.group, self.inbox = state, place, group, inbox
        self.membership, self.flow, self.records, self.shape = membership, flow, records, shape
        self.ddp_options = ddp_options
        self.checkpoint_every = checkpoint_every
        self.watch = watch
        self.save = save
        self.stopped = stopped
        self.agreement = Agreement(device)
        self.ddp: Any = None
        # The micro-batch handed to the loop and not yet trained (the loop may not read ahead).
        self.handed: _data.Micro | None = None
        # What the last step's agreement decided, for the next boundary (regroup.after_step).
        self.pending: regroup.AfterStep | None = None
        self.in_step = False
        # The job itself steps the optimizer now (the guards let it).
        self.stepping = False
        # A DivergedError raised: every later call into the job raises it again.
        self.diverged: DivergedError | None = None
        # The global step before the epoch's first step (the epoch's counter runs from it).
        self.epoch_first_step = 0
        # The samples of the step under way (its micro-batches so far), its times.
        self._trained: list[int] = []
        self._samples = 0
        self._started: float | None = None
        self._data_s = 0.0
        self._last_exit: float | None = None

    # --- the model's DDP wrapper ------------------------------------------------------------------

    def wrap(self, module: torch.nn.Module, backend: str, device: torch.device) -> None:
        """``module`` in DDP over the group just started, its comm hook the agreement's."""
        device_ids = [device.index] if backend == "nccl" else None
        self.ddp = DistributedDataParallel(module, device_ids=device_ids, **self.ddp_options)
        self.ddp.register_comm_hook(None, self.agreement.comm_hook)

    def unwrap(self) -> None:
        self.ddp = None

    # --- the block ------------------------------------------------------------------------------

    def enter(self, step: Step) -> None:
        if self.diverged is not None:
            raise self.diverged
        if self.in_step:
            raise UsageError("`with job.step():` inside another: one block per micro-batch")
        if self.handed is None:
            raise UsageError(
                "`with job.step():` without a batch of the job: each step trains the next batch of "
                "job.batches() or job.loader()"
            )
        _guards.refuse_stray_scheduler(self.state.optimizer, self.state.scheduler)
        micro = self.handed
        self.in_step = True
        self.inbox.drain()
        now = time.monotonic()
        if micro.part == 0:
            self._trained, self._samples = [], 0
            # Waiting for this batch: since the last step ended (the loop's own loading).
            self._started = now
            self._data_s = now - self._last_exit if self._last_exit is not None else 0.0
        step.started, step.data_s = self._started or now, self._data_s
        self._trained += micro.trained
        self._samples += len(micro.indices)
        step.sync = micro.last
        step.first = micro.part == 0
        if self.ddp is not None:
            self.ddp.require_backward_grad_sync = micro.last
        if micro.last:
            raised = regroup.raised(
                self.stopped(), self.inbox.assigned is not None, self.inbox.leaving, self.place.rank
            )
            parts = flags(raised, self._trained)
            parts += _check.slots(self.place.rank, self.place.world_size, self.state.state_hash())
            self.agreement.prepare(parts, self._time_slots)

    def exit(self, step: Step, exc: BaseException | None) -> bool:
        """The block's end: whether to swallow its exception (a lost peer's, after the regroup)."""
        self.in_step = False
        micro, self.handed = self.handed, None
        assert micro is not None
        try:
            if exc is not None:
                if self.regroups(exc, self._started):
                    self._drop(exc)
                    step._applied = False
                    return True
                return False
            if not micro.last:
                self.flow.step_ended(applied=False)
                step._applied = False
                return False
            try:
                outcome = self.agreement.agree(self.place.world_size, self.state.module, self.ddp_options)
            except Exception as e:  # noqa: BLE001 - sorted below
                if self.regroups(e, self._started):
                    self._drop(e)
                    step._applied = False
                    return False
                raise
            try:
                self._apply(step, micro, outcome)
            except DivergedError as e:
                self.diverged = e
                raise
            step._applied = True
            return False
        finally:
            self._last_exit = time.monotonic()

    # --- the update -----------------------------------------------------------------------------

    def _apply(self, step: Step, micro: _data.Micro, outcome: Outcome) -> None:
        state, p, place = self.state, self.state.progress, self.place
        where = f"at step {p.global_step + 1} (epoch {p.epoch})"
        _check.compare(outcome.hashes, where, place.rank, state.counters)
        self._update()
        p.global_step += 1
        p.position = micro.position_after
        p.samples_seen += outcome.samples
        p.epoch_digest = (p.epoch_digest + outcome.digest) & MASK
        self.flow.step_ended(applied=True)
        speeds = stragglers.relative_speeds(outcome.times) if outcome.times else []
        done = Done(
            started=step.started,
            data_s=step.data_s,
            epoch_first_step=self.epoch_first_step,
            samples=self._samples,
            lr=float(state.optimizer.param_groups[0].get("lr", 0.0)),
            loss=step.loss,
            correct=step.correct,
            slowdown=speeds[place.rank] if place.rank < len(speeds) else None,
        )
        self.records.step(place.rank, place.world_size, p, done)
        if self.watch is not None and outcome.times:
            change = self.watch.step(outcome.times)
            if change is not None:
                self._straggler(change)
        epoch_ends = p.position >= self.shape.dataset_size
        due = regroup.checkpoint_due(p.global_step, self.checkpoint_every, epoch_ends)
        self.pending = regroup.after_step(outcome.agreed, self.inbox.leaving, due)

    def _update(self) -> None:
        """The step's update: the optimizer's step (through the GradScaler, and its update,
        when there is one), the gradients cleared."""
        optimizer, scaler = self.state.optimizer, self.state.scaler
        self.stepping = True
        try:
            if scaler is not None:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
        finally:
            self.stepping = False
        optimizer.zero_grad(set_to_none=True)

    # --- a lost peer ----------------------------------------------------------------------------

    def regroups(self, e: BaseException, since: float | None) -> bool:
        """Whether ``e``, raised by a collective ``since`` (a monotonic time) or after, costs a
        regroup (the step dropped) rather than the run; with no agent, a lost peer's failure
        first has rank 0 save the last step every rank completed (``regroup.after_failure``)."""
        if isinstance(e, (UsageError, DivergedError)):
            return False
        waited = time.monotonic() - since if since is not None else 0.0
        decision = regroup.after_failure(self.group.failure(e, waited), self.inbox.attached, self.place.rank)
        if decision.save:
            try:
                self.save()
            except Exception as saving:  # noqa: BLE001 - the run fails with e either way
                step = self.state.progress.global_step
                say(f"a peer was lost and the checkpoint of step {step} could not be saved: {saving}")
        return decision.do is regroup.Do.REGROUP

    def _drop(self, e: BaseException) -> None:
        """A peer lost in the step under way: its gradients dropped, the workers regrouped."""
        self.state.optimizer.zero_grad(set_to_none=True)
        self._trained, self._samples = [], 0
        self.flow.step_ended(applied=False)
        self.membership.regroup(why(e), lost=True, detail=detail(e))
        # What the loop's code after this block changes in the kept state is undone at the
        # next boundary: this rank's state (its own, or a peer's) is whole as of now.
        self.kept.hold()

    @property
    def kept(self) -> Kept:
        return self.state.kept

    # --- times and stragglers -------------------------------------------------------------------

    def _time_slots(self, device: torch.device) -> torch.Tensor:
        """This rank's times before the all-reduce, in its own slots of the step's agreement."""
        started = self._started if self._started is not None else time.monotonic()
        place = self.place
        v = stragglers.slots(place.rank, place.world_size, self._data_s, time.monotonic() - started, place.node)
        return torch.tensor(v, dtype=torch.float32, device=device)

    def _straggler(self, change: Any) -> None:
        """A straggler found or gone: rank 0 says so and records it; the straggler's own node
        (its local rank 0) tells its agent, which may evict it (``--stragglers evict``)."""
        assert self.watch is not None
        if change[0] == "started":
            s = change[1]
            slow, node, text = True, s["node"], stragglers.started_text(s, self.watch.window)
            record = dict(s, slow=True)
        else:
            _, node, slowdown = change
            slow, text = False, stragglers.ended_text(node, slowdown)
            record = {"slow": False, "node": node, "ranks": [], "slowdown": slowdown or 0.0}
        if self.place.rank == 0:
            print(text, flush=True)
            self.records.write(0, "straggler", rank=0, step=self.state.progress.global_step, **record)
        if node == self.place.node and os.environ.get("LOCAL_RANK", "0") == "0":
            self.inbox.send(ctl.straggler(slow, text))
