"""``Elastic``: the training loop's state and its regroup in place (see the package's doc).

The loop's calls into the job are its *boundaries*: the batch iterator asking for the next
batch, ``job.epochs()`` asking for the next epoch, ``job.evaluate()`` and ``job.finish()``.
What a step's agreement decides (pause for a new round, stop, checkpoint) is carried out at
the next boundary, after the loop's own code between steps (its scheduler step, its logging)
has run on every rank: the state that then travels to a joiner or into the checkpoint is the
state a rank holds at the top of the next step, which is where a rank that starts the
program afresh comes in. A lost peer is handled at once: its collective failed, and the step
is dropped.

A group's start, the state made the same on every rank and the regroup are ``_membership``'s;
what the worker does at each turn is ``trainctl.regroup``'s, the protocol's tables shared
with the built-in trainer.

Each step's flags (stop, pause, leave, the samples trained and their digest, each rank's state
hash and times) ride the last bucket of DDP's gradient all-reduce (``_comm_hook``), or, when
that cannot carry them, an all-reduce of their own (``_agree``); the optimizer steps after it:
a step is applied on a rank only once every rank agreed it is whole, so after a peer is lost
the survivors hold the same step or one step apart, and the furthest streams.
"""

from __future__ import annotations

import atexit
import os
import re
import signal
import sys
import threading
import time
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from .. import control as ctl
from .. import regroup, stragglers
from ..sampler import MASK, digest
from . import _check, _data, _guards, _membership, _state
from ._errors import DivergedError, UsageError
from ._flow import Flow
from ._group import Group, detail, say, why
from ._kept import Kept
from ._records import Records
from ._strays import Strays

# A run id that torchrun makes anew at every launch (--standalone, or one node without an
# endpoint): a relaunch would not find its checkpoint under it.
_UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")

# The step's flags before the ranks' slots: stop, pause, leaving, rank 0 leaving, samples,
# and the samples' digest in eight 8-bit limbs.
_FLAGS = 13


class Step:
    """One ``with job.step() as step:`` block: one micro-batch. Set ``step.loss`` (and
    ``step.correct``, the right predictions of this rank's batch) for the records and the loss
    lines. ``step.sync`` is True on the micro-batch whose end applies the update (always, unless
    ``accumulate`` > 1). After the block, ``step.applied`` says whether it applied the update:
    code that changes state after an update (an EMA of your own, a counter) runs only ``if
    step.applied:``."""

    def __init__(self, job: Elastic):
        self.job = job
        self.loss: Any = None
        self.correct: Any = None
        self.sync = True
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
        self.job._enter_step(self)
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        return self.job._exit_step(self, exc)


class Elastic:
    """A data-parallel training run that regroups in place. A loop with a per-step scheduler,
    gradient accumulation, mixed precision, DataLoader workers and an evaluation::

        job = Elastic(model, optimizer, dataset_size=len(train), batch_size=64, accumulate=2,
                      scheduler=scheduler, scaler=scaler, out="runs")
        loader = job.loader(train, num_workers=2)      # DataLoader's arguments
        for epoch in job.epochs(10):
            for x, y in loader:
                with job.step() as step:                # one micro-batch
                    with torch.autocast("cuda", dtype=torch.float16):
                        loss = F.cross_entropy(job.model(x), y) / 2
                    scaler.scale(loss).backward()       # the job steps optimizer and scaler
                    step.loss = loss.item() * 2
                scheduler.step()                        # only after an update the job applied
            accuracy = job.evaluate(test_accuracy, job.module, test_images, test_labels)
        job.finish()

    (``test_accuracy`` all-reduces: collectives go inside ``job.step()`` or
    ``job.evaluate()``.) What each pattern needs, and what is refused: docs/PYTORCH.md in the
    trainctl repository.

    Required: ``model`` (an ``nn.Module``; ``job.model`` is it wrapped in DDP, ``job.module``
    the model itself), ``optimizer``, ``dataset_size`` and ``batch_size`` (samples per rank in
    one forward and backward). Optional:

    - ``accumulate``: micro-batches per update (gradient accumulation; one ``with
      job.step():`` per micro-batch, the gradients all-reduced once, on the last).
    - ``scheduler``: the LR scheduler you step after ``with job.step():`` (per step or per
      epoch); it travels to joiners and into the checkpoint, and a ``scheduler.step()`` that
      follows no applied update (a dropped step, a micro-batch) does nothing.
    - ``scaler``: a ``torch.amp.GradScaler``; the job steps the optimizer through it and
      updates it; you call ``scaler.scale(loss).backward()``.
    - ``state``: what else the loop keeps, to travel with the model and into the checkpoint:
      an object with ``state_dict``/``load_state_dict`` (tensors and plain values), or a list
      or dict of them: an EMA (torch's ``AveragedModel``, whose ``update_parameters`` the job
      gates as it gates the scheduler), your best accuracy so far. Every rank must hold it
      alike (the safety net compares it); see docs/PYTORCH.md.
    - ``start_epoch``: the epoch to start at when neither a peer nor the job's checkpoint has a
      state (you loaded a checkpoint of your own into the model and optimizer).
    - ``on_resize(old, new)``: called on every rank when the world size the state was trained
      at changes (a regroup, a resume at another size), to rescale the learning rate.
    - ``seed``: the epoch's order is ``DistributedSampler``'s (``torch.randperm`` seeded by
      seed + epoch).
    - ``out``, ``run_id``, ``checkpoint``, ``checkpoint_every``: files go to ``OUT/RUN_ID/``
      (``metrics/rank-N.jsonl``; ``checkpoint.pt``, written by rank 0 every epoch and every
      ``checkpoint_every`` steps, read at a start that no rank can take from a peer). The run
      id is ``TORCHELASTIC_RUN_ID``, or ``local`` with no launcher and where torchrun makes a
      new one at every launch (``--standalone``: a UUID, which a relaunch would not find).
    - ``print_freq``, ``config``, ``backend``, ``ddp`` (more arguments of
      ``DistributedDataParallel``), ``straggler_factor``, ``straggler_window``.

    ``job.rank`` and ``job.world_size`` are this rank's place now (they change at a regroup).
    SIGTERM (the whole job stopped) finishes the step under way on every rank, checkpoints it
    and exits 143: the constructor installs that handler.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        dataset_size: int,
        batch_size: int,
        accumulate: int = 1,
        seed: int = 0,
        scheduler: Any = None,
        scaler: Any = None,
        state: Any = None,
        start_epoch: int = 0,
        on_resize: Callable[[int, int], None] | None = None,
        out: str = "runs",
        run_id: str | None = None,
        checkpoint: str | None = None,
        checkpoint_every: int | None = None,
        print_freq: int = 0,
        backend: str | None = None,
        ddp: dict[str, Any] | None = None,
        config: dict[str, Any] | None = None,
        straggler_factor: float = 1.5,
        straggler_window: int = 5,
    ):
        if dataset_size <= 0 or batch_size <= 0 or accumulate <= 0:
            raise ValueError(
                f"dataset_size {dataset_size}, batch_size {batch_size} and accumulate {accumulate}: "
                "each must be positive"
            )
        _refuse_at_start(model, optimizer, scheduler)
        self.module = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.scaler = scaler
        self.kept = Kept(state)
        self.dataset_size = int(dataset_size)
        self.batch_size = int(batch_size)
        self.accumulate = int(accumulate)
        self.seed = int(seed)
        self.on_resize = on_resize
        self.checkpoint_every = checkpoint_every
        self.print_freq = print_freq
        self.config = dict(config or {})
        self.ddp_options = dict(ddp or {})
        # Under a launcher (torchrun, trainctl run); otherwise a group of one.
        # Started warm (trainctl run, a node joining a job under way): no place in the job
        # yet; the first group waits for the round the agent hands it.
        self.warm = os.environ.get(_membership.WARM_WORKER) == "1"
        self.launched = self.warm or "WORLD_SIZE" in os.environ
        self.rank = int(os.environ.get("RANK", "0")) if self.launched else 0
        self.world_size = int(os.environ.get("WORLD_SIZE", "0" if self.warm else "1")) if self.launched else 1
        self.run_id = run_id or _run_id(self.launched)
        self.run_dir = os.path.join(out, self.run_id)
        self.checkpoint_path = checkpoint or os.path.join(self.run_dir, "checkpoint.pt")
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self.device = (
            torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            if self.backend == "nccl"
            else torch.device("cpu")
        )
        self.progress = dict(_state.PROGRESS_DEFAULTS, epoch=int(start_epoch))
        # A state this worker trained (or took whole from a peer), not a stream cut off.
        self.live = False
        self.stop_requested = False
        self.group = Group(self.backend, self.device, self.launched)
        self._ddp: DistributedDataParallel | None = None
        self._generation = 0
        # The micro-batch handed to the loop and not yet trained (the loop may not read ahead).
        self._handed: _data.Micro | None = None
        # What the last step's agreement decided, for the next boundary (regroup.after_step).
        self._pending: regroup.AfterStep | None = None
        self._assigned: list[tuple[str, str]] | None = None
        self._assignments = 0
        self._leaving = False
        self._order_cache: tuple[int, list[int]] | None = None
        self._flow = Flow()
        self._in_step = False
        self._stepping = False
        # The samples of the step under way (its micro-batches so far), and its batch size.
        self._step_trained: list[int] = []
        self._step_samples = 0
        self._flags_out: torch.Tensor | None = None
        self._flags_in: torch.Tensor | None = None
        self._hook_ran = False
        # The weights' and the kept state's fingerprints as of the last check (_fingerprint).
        self._weights_fp = 0
        self._kept_fps: dict[str, int] = {}
        # Copies of the model the loop keeps without giving them (refused once they change).
        self._strays = Strays(model)
        # A DivergedError raised: every later call into the job raises it again.
        self._diverged: DivergedError | None = None
        # The step of the first look for copies of the model, and whether they were checked.
        self._strays_at = 0
        self._strays_checked = False
        # The straggler watch (as the built-in trainer's; window 0: none) and the step's times.
        self._watch = stragglers.Watch(straggler_factor, straggler_window) if straggler_window else None
        self._last_exit: float | None = None
        # This worker's node in the round (its group rank), for the straggler watch's slots.
        self._node = int(os.environ.get("GROUP_RANK", "0"))
        self._step_started: float | None = None
        self._step_data_s = 0.0
        self._epoch_mark: tuple[int, float, int] | None = None
        self._records = Records(self.run_dir, print_freq)
        self._started = False
        # Until this process's first group has started (see _sync's `came_in`).
        self._first_start = True
        self.epochs_total = 0
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_sigterm)
        self._hook = _guards.guard_optimizer(self, optimizer)
        if scheduler is not None:
            _guards.gate_scheduler(self, scheduler)
        if scaler is not None:
            _guards.guard_scaler(self, scaler)
        self.kept.gate(self._after_update_may_run)
        _guards.refuse_stray_scalers()
        _guards.refuse_other_optimizers()
        _guards.set_live(self)
        # A loop that ends by an exception still tears the group down (a process that exits
        # with gloo's threads running aborts, hiding the exception's exit code), and a
        # collective that lost a peer outside the job's steps says where collectives go.
        self._excepthook = sys.excepthook
        sys.excepthook = self._on_uncaught
        atexit.register(self._at_exit)
        self.control = None
        if self.launched:
            try:
                self.control = ctl.Channel.from_env(on_message=self.group.on_message)
                if self.control is not None:
                    self.control.send(ctl.ready())
            except ctl.ControlError as e:
                say(f"the agent's control channel cannot be used: {e}; a change of group restarts this worker")
                self.control = None
        self._synced = _membership.warm_start(self) if self.warm else _membership.first_start(self)

    # --- what the training loop uses ---------------------------------------------------------

    @property
    def model(self) -> torch.nn.Module:
        """The model to train: wrapped in ``DistributedDataParallel`` (again after a regroup),
        so read it inside each step, not once."""
        return self._ddp if self._ddp is not None else self.module

    def epochs(self, n: int) -> Iterator[int]:
        """The epochs left of ``n`` (0-based), from where the run stands."""
        self.epochs_total = int(n)
        if not self._started:
            self._started = True
            self._records.start(self)
        while self.progress["epoch"] < self.epochs_total:
            yield self.progress["epoch"]
            # After the loop's own code at the epoch's end; an epoch whose batches the loop
            # left before their end goes on.
            self._boundary()
            if self.progress["position"] >= self.dataset_size:
                self._end_epoch()

    def batches(self) -> _data.Batches:
        """This rank's sample indices for each micro-batch left in the epoch, re-sharded from
        the position all ranks agree on after a regroup: iterate it, or give it to a DataLoader
        as ``batch_sampler`` (without worker processes: ``job.loader()`` has them). Train each
        inside ``with job.step():`` before asking for the next."""
        return _data.Batches(self)

    def loader(self, dataset: Any, **kwargs: Any) -> _data.Loader:
        """A DataLoader of ``dataset`` over this rank's batches of the rest of the epoch;
        ``kwargs`` are DataLoader's (``num_workers``, ``collate_fn``, ``pin_memory``,
        ``persistent_workers``, ...), not the batching, which is the job's. When the group
        changes, what its workers read ahead is dropped and loading goes on as the new group
        shards the epoch."""
        return _data.Loader(self, dataset, kwargs)

    def step(self) -> Step:
        """One micro-batch: the optimizer steps at the end of a step's last one, once every
        rank agreed the step is whole; a lost peer drops the step and the workers regroup in
        place (the block's exception is swallowed, and the loop goes on)."""
        return Step(self)

    def evaluate(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` between steps, with the collectives it runs made elastic: a
        peer lost meanwhile regroups the workers in place and ``fn`` runs again in the new
        group. A node joining or leaving at the step before waits until the next batch: the
        evaluation runs in the group that trained that step. Returns what ``fn`` returns, or
        None on the ranks that must skip it (rare; each skip is said): a rank that came into
        the group skips the evaluations the others made before it came in, and when a peer is
        lost in one and the new group has a newcomer, every rank skips it (``fn`` would wait
        for the newcomer, which is not there)."""
        if self._in_step:
            raise UsageError(
                "job.evaluate() inside `with job.step():`: evaluate between steps (after the block, "
                "or after the epoch's batches)"
            )
        p = self.progress
        synced = self._boundary(pause_after=True)
        if p["epoch_end_evals"] >= 0:
            p["epoch_end_evals"] += 1
        if synced is not None and synced["fresh"]:
            return self._skip_evaluation("a node joined the group at this step")
        if not self._flow.evaluation_runs():
            return self._skip_evaluation("this rank came into the group after the others made it")
        while True:
            started = time.monotonic()
            try:
                return fn(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 - sorted below
                if not self._regroups(e, started):
                    raise
                synced = _membership.regroup(self, why(e), saver=self.rank == 0, lost=True, detail=detail(e))
                if synced["fresh"]:
                    return self._skip_evaluation("a peer was lost while it ran, and a node joined the new group")

    def finish(self) -> None:
        """The run's end: every rank checks that all hold the same weights, says where it ended
        (its weights' fingerprint), and the group and the channel are closed."""
        self._boundary()
        if self.world_size > 1 and dist.is_initialized():
            # Every rank past its last collective before any tears the group down (a group
            # torn down under a peer's gloo thread can abort that process), the weights
            # compared one last time, and rank 0's buffers (batch norm's running statistics,
            # which DDP sends from rank 0 at each forward) made every rank's: whichever rank
            # saves the model saves the same one.
            self._fingerprint()
            mine = torch.tensor([_check.state_hash(_check.counters(self))], dtype=torch.int64, device=self.device)
            everyone = [torch.zeros_like(mine) for _ in range(self.world_size)]
            try:
                dist.all_gather(everyone, mine)
                for b in self.module.buffers():
                    dist.broadcast(b.data, src=0)
            except Exception:  # noqa: BLE001 - at the end, a peer gone changes nothing
                everyone = []
            if everyone:
                _check.compare(self, [int(t.item()) for t in everyone], "at the end of the run")
        if self.control is not None:
            # Training is over: the agent must not regroup or restart this worker when a peer
            # goes while the program's own end (saving, an evaluation) runs.
            self.control.send(ctl.finished())
        p = self.progress
        print(
            f"rank {self.rank} finished after {p['global_step']} steps; weights fingerprint "
            f"{self.fingerprint():08x} (world size {self.world_size}, {p['samples_seen']} samples trained in all)",
            flush=True,
        )
        _membership.teardown(self)
        if self.control is not None:
            self.control.close()
        self._records.close()
        self._hook.remove()
        _guards.set_live(None)
        sys.excepthook = self._excepthook
        atexit.unregister(self._at_exit)

    def fingerprint(self) -> int:
        """A CRC32 of the model's parameters and buffers: equal on ranks that hold the same."""
        return _check.crc32(self.module.state_dict().values())

    # --- the loop's boundaries -----------------------------------------------------------------

    def _iterate(self, on_plan: Callable[[list[_data.Micro]], None] | None = None) -> Iterator[_data.Micro]:
        """The rest of the epoch, one micro-batch at a time, with a boundary after each; planned
        again after a regroup."""
        self._handed = None
        self._boundary()
        self._mark_epoch()
        while True:
            planned = self._plan()
            if not planned:
                self._batches_ended()
                return
            if on_plan is not None:
                on_plan(planned)
            generation = self._generation
            for micro in planned:
                self._handed = micro
                yield micro
                if self._handed is not None:
                    raise UsageError(
                        "the next batch was asked for before this one was trained: a DataLoader with "
                        "worker processes reads job.batches() ahead, and a regroup would re-plan the "
                        "epoch under it. Use job.loader(dataset, num_workers=..., ...) (the "
                        "DataLoader's own arguments; it drops what it read ahead when the group "
                        "changes), or num_workers=0; and train every batch inside `with job.step():`"
                    )
                self._boundary()
                if self._generation != generation:
                    break

    def _boundary(self, pause_after: bool = False) -> dict[str, Any] | None:
        """Carries out what the last step's agreement decided; with ``pause_after`` (an
        evaluation), a pause (a regroup, this node's leave) waits for the next boundary, so
        that the evaluation runs in the group that trained the step. Returns the new group's
        sync when it regrouped. First, what the loop changed in the kept state after a step
        that applied no update is undone, and the copies of the model it keeps are looked at."""
        if self._diverged is not None:
            raise self._diverged
        undone = self.kept.undo()
        if undone:
            say(
                f"rank {self.rank}: the loop changed {', '.join(undone)} after a step that applied no "
                "update (a peer was lost and the step dropped); undone, so that it follows the updates "
                "the job applied. Change it only `if step.applied:` after `with job.step() as step:`"
            )
        self._watch_strays()
        pending = self._pending
        if pending is None or pending.do is regroup.Do.CONTINUE:
            self._pending = None
            return None
        if pause_after and pending.do in (regroup.Do.REGROUP, regroup.Do.LEAVE):
            return None
        self._pending = None
        if pending.do is regroup.Do.CHECKPOINT:
            self._checkpoint()
        elif pending.do is regroup.Do.STOP:
            _membership.stop(self, pending.saver)
        elif pending.do is regroup.Do.LEAVE:
            _membership.leave(self)
        elif pending.do is regroup.Do.REGROUP:
            return _membership.regroup(self, "paused for a new round", saver=self.rank == pending.saver, lost=False)
        return None

    def _skip_evaluation(self, reason: str) -> Any:
        say(
            f"rank {self.rank} skips an evaluation ({reason}): job.evaluate() returns None here, so "
            "use its result only `if result is not None:` (the ranks that ran it have it)"
        )
        return None

    def _after_update_may_run(self, what: str) -> bool:
        """Whether the loop's ``what`` (``scheduler.step()``, an AveragedModel's
        ``update_parameters()``) runs: only after a block that applied an update (see
        ``_guards.gate_method``)."""
        if self._in_step:
            raise UsageError(
                f"{what} inside `with job.step():`: the job steps the optimizer at the block's end, "
                f"so call {what} after the block (per step or per epoch), as PyTorch documents "
                "(after optimizer.step())"
            )
        return not self._flow.void

    def _fingerprint(self) -> None:
        """The weights' and the kept state's fingerprints, for the safety net's next checks."""
        self._weights_fp = _check.fingerprint(self.module)
        self._kept_fps = self.kept.fingerprints()

    def _watch_strays(self) -> None:
        """The copies of the model the loop keeps without giving them: looked for after the
        first update, and those found refused if they changed two updates later (and at every
        epoch's end)."""
        step, strays = self.progress["global_step"], self._strays
        if not strays.scans:
            if step >= 1:
                self._scan_strays()
                self._strays_at = step
        elif step >= self._strays_at + 2 and not self._strays_checked:
            self._strays_checked = True
            strays.refuse_changed()

    def _scan_strays(self) -> None:
        known: list[Any] = [self._ddp, self.optimizer, self.scheduler, self.scaler, *self.kept.parts()]
        self._strays.scan(o for o in known if o is not None)

    # --- epochs --------------------------------------------------------------------------------

    def _plan(self) -> list[_data.Micro]:
        p = self.progress
        return _data.plan(
            self._order(p["epoch"]),
            p["position"],
            self.world_size,
            self.rank,
            self.batch_size,
            self.accumulate,
            self._generation,
        )

    def _order(self, epoch: int) -> list[int]:
        if self._order_cache is None or self._order_cache[0] != epoch:
            g = torch.Generator()
            g.manual_seed(self.seed + epoch)
            self._order_cache = (epoch, torch.randperm(self.dataset_size, generator=g).tolist())
        return self._order_cache[1]

    def _mark_epoch(self) -> None:
        epoch = self.progress["epoch"]
        if self._epoch_mark is None or self._epoch_mark[0] != epoch:
            done = -(-self.progress["position"] // (self.batch_size * self.accumulate * self.world_size))
            self._epoch_mark = (epoch, time.monotonic(), self.progress["global_step"] - done)

    def _batches_ended(self) -> None:
        """The epoch's batches are all trained: its record (the digest proves each sample was
        trained once), once."""
        came_in_here = self._flow.evaluate_from == "batches"
        self._flow.batches_ended()
        p = self.progress
        if p["epoch_end_evals"] >= 0:
            if came_in_here:
                # Its evaluations count from here, as the others' did (see Flow).
                p["epoch_end_evals"] = 0
            return
        p["epoch_end_evals"] = 0
        mark = self._epoch_mark or (p["epoch"], time.monotonic(), p["global_step"])
        self._records.epoch(self, time.monotonic() - mark[1])

    def _end_epoch(self) -> None:
        """After the loop's own code at the epoch's end (its evaluation, its scheduler step):
        the next epoch, its state checked and checkpointed."""
        if self.progress["epoch_end_evals"] < 0:
            self._batches_ended()
        p = self.progress
        p["epoch"] += 1
        p["position"] = 0
        p["epoch_digest"] = 0
        p["epoch_end_evals"] = -1
        self._flow = Flow()
        self._fingerprint()
        self._strays.refuse_changed()
        if self._strays.scans == 1:
            # Copies made during the first epoch (an EMA made lazily) are found here.
            self._scan_strays()
        self._checkpoint()

    # --- one step ------------------------------------------------------------------------------

    def _enter_step(self, step: Step) -> None:
        if self._diverged is not None:
            raise self._diverged
        if self._in_step:
            raise UsageError("`with job.step():` inside another: one block per micro-batch")
        if self._handed is None:
            raise UsageError(
                "`with job.step():` without a batch of the job: each step trains the next batch of "
                "job.batches() or job.loader()"
            )
        _guards.refuse_stray_scheduler(self.optimizer, self.scheduler)
        micro = self._handed
        self._in_step = True
        self._drain()
        now = time.monotonic()
        if micro.part == 0:
            self._step_trained, self._step_samples = [], 0
            # Waiting for this batch: since the last step ended (the loop's own loading).
            self._step_started = now
            self._step_data_s = now - self._last_exit if self._last_exit is not None else 0.0
        step.started, step.data_s = self._step_started or now, self._step_data_s
        self._step_trained += micro.trained
        self._step_samples += len(micro.indices)
        step.sync = micro.last
        if self._ddp is not None:
            self._ddp.require_backward_grad_sync = micro.last
        if micro.last:
            # For the gradient all-reduce's last bucket to carry (`_comm_hook`); unless it does
            # (no backward, gradients that are not float32), `_agree` reduces them on their own.
            flags = self._flags(self._step_trained)
            flags += _check.slots(self.rank, self.world_size, _check.state_hash(_check.counters(self)))
            self._flags_out = torch.tensor(flags, dtype=torch.float32, device=self.device)
            self._flags_in = None
            self._hook_ran = False

    def _exit_step(self, step: Step, exc: BaseException | None) -> bool:
        self._in_step = False
        micro, self._handed = self._handed, None
        assert micro is not None
        try:
            if exc is not None:
                if self._regroups(exc, self._step_started):
                    self._drop(exc)
                    step._applied = False
                    return True
                return False
            if not micro.last:
                self._flow.step_ended(applied=False)
                step._applied = False
                return False
            try:
                outcome = self._agree()
            except Exception as e:  # noqa: BLE001 - sorted below
                if self._regroups(e, self._step_started):
                    self._drop(e)
                    step._applied = False
                    return False
                raise
            try:
                self._apply(step, micro, outcome)
            except DivergedError as e:
                self._diverged = e
                raise
            step._applied = True
            return False
        finally:
            self._last_exit = time.monotonic()

    def _drain(self) -> None:
        """The agent's messages that came while training: an assignment (the next round, taken
        after the step all ranks pause at) or this node's leave."""
        if self.control is None:
            return
        while True:
            try:
                message = self.control.recv(0)
            except ctl.ControlError:
                # A broken channel shows when the worker next needs it.
                return
            if message is None:
                return
            self._take(message)

    def _take(self, message: Any) -> None:
        if isinstance(message, ctl.Assign):
            self._assigned = message.env
            self._assignments += 1
        elif isinstance(message, ctl.Leave):
            self._leaving = True

    def _flags(self, trained: list[int]) -> list[float]:
        """This rank's part of the step's agreement: stop, pause, leave, whether rank 0 leaves,
        and the samples trained with their digest in eight 8-bit limbs (summed exactly in
        float32 by up to 65,536 ranks)."""
        d = digest(trained)
        r = regroup.raised(self.stop_requested, self._assigned is not None, self._leaving, self.rank)
        flags = [float(r.stop), float(r.pause), float(r.leave), float(r.rank0_leaves), float(len(trained))]
        return flags + [float((d >> (8 * k)) & 0xFF) for k in range(8)]

    def _comm_hook(self, _state, bucket):  # type: ignore[no-untyped-def]
        """DDP's gradient all-reduce (averaged, as DDP's own), whose last bucket also carries
        the step's flags: the agreement costs no collective of its own. (No annotations: DDP
        checks the hook's, and takes only its own classes there.)"""
        self._hook_ran = True
        t = bucket.buffer()
        n, world = t.numel(), dist.get_world_size()
        flags = self._flags_out
        if bucket.is_last() and flags is not None and t.dtype == torch.float32:
            self._flags_out = None
            joined = torch.cat([t, flags, self._time_slots(t.device)])
            fut = dist.all_reduce(joined, async_op=True).get_future()

            def split(fut: Any) -> torch.Tensor:
                out = fut.value()[0]
                self._flags_in = out[n:].clone()
                return out[:n].div_(world)

            return fut.then(split)
        fut = dist.all_reduce(t, async_op=True).get_future()
        return fut.then(lambda fut: fut.value()[0].div_(world))

    def _agree(self) -> dict[str, Any]:
        """The step's flags over all ranks: from the gradient all-reduce when it carried them,
        else by an all-reduce of their own."""
        t, flags_out = self._flags_in, self._flags_out
        self._flags_in = self._flags_out = None
        world = self.world_size
        if t is None:
            _guards.refuse_unreduced(self.module, self._hook_ran, self.ddp_options)
            assert flags_out is not None
            t = torch.cat([flags_out, self._time_slots(self.device)])
            dist.all_reduce(t)
        values = t.tolist()
        v = [int(round(x)) for x in values[:_FLAGS]]
        checks = _FLAGS + _check.SLOTS * world
        times = values[checks:]
        return {
            "hashes": _check.unpack(values[_FLAGS:checks], world),
            "times": stragglers.unpack(times, world) if len(times) == stragglers.SLOTS * world else [],
            "agreed": regroup.Agreed(stop=v[0], pause=v[1], leave=v[2], rank0_leaves=v[3]),
            "samples": v[4],
            "digest": sum(v[5 + k] << (8 * k) for k in range(8)) & MASK,
        }

    def _apply(self, step: Step, micro: _data.Micro, outcome: dict[str, Any]) -> None:
        p = self.progress
        _check.compare(self, outcome["hashes"], f"at step {p['global_step'] + 1} (epoch {p['epoch']})")
        self._update()
        p["global_step"] += 1
        p["position"] = micro.position_after
        p["samples_seen"] += outcome["samples"]
        p["epoch_digest"] = (p["epoch_digest"] + outcome["digest"]) & MASK
        self._flow.step_ended(applied=True)
        times = outcome["times"]
        speeds = stragglers.relative_speeds(times) if times else []
        self._records.step(self, step, speeds[self.rank] if self.rank < len(speeds) else None)
        if self._watch is not None and times:
            change = self._watch.step(times)
            if change is not None:
                self._straggler(change)
        # The epoch's end checkpoints anyway.
        every = self.checkpoint_every or 0
        due = every > 0 and p["global_step"] % every == 0 and p["position"] < self.dataset_size
        self._pending = regroup.after_step(outcome["agreed"], self._leaving, due)

    def _update(self) -> None:
        """The step's update: the optimizer's step (through the GradScaler, and its update,
        when there is one), the gradients cleared."""
        self._stepping = True
        try:
            if self.scaler is not None:
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:
                self.optimizer.step()
        finally:
            self._stepping = False
        self.optimizer.zero_grad(set_to_none=True)

    def _regroups(self, e: BaseException, since: float | None) -> bool:
        """Whether ``e``, raised by a collective ``since`` (a monotonic time) or after, costs a
        regroup (the step dropped) rather than the run; with no agent, a lost peer's failure
        first has rank 0 save the last step every rank completed (``regroup.after_failure``)."""
        if isinstance(e, (UsageError, DivergedError)):
            return False
        waited = time.monotonic() - since if since is not None else 0.0
        decision = regroup.after_failure(self.group.failure(e, waited), self.control is not None, self.rank)
        if decision.save:
            try:
                self._checkpoint()
            except Exception as saving:  # noqa: BLE001 - the run fails with e either way
                say(f"a peer was lost and the checkpoint of step {self.progress['global_step']} could not be saved: {saving}")
        return decision.do is regroup.Do.REGROUP

    def _drop(self, e: BaseException) -> None:
        """A peer lost in the step under way: its gradients dropped, the workers regrouped."""
        self.optimizer.zero_grad(set_to_none=True)
        self._step_trained, self._step_samples = [], 0
        self._flow.step_ended(applied=False)
        _membership.regroup(self, why(e), saver=self.rank == 0, lost=True, detail=detail(e))
        # What the loop's code after this block changes in the kept state is undone at the
        # next boundary: this rank's state (its own, or a peer's) is whole as of now.
        self.kept.hold()

    def _time_slots(self, device: torch.device) -> torch.Tensor:
        """This rank's times before the all-reduce, in its own slots of the step's agreement."""
        started = self._step_started if self._step_started is not None else time.monotonic()
        v = stragglers.slots(
            self.rank,
            self.world_size,
            self._step_data_s,
            time.monotonic() - started,
            self._node,
        )
        return torch.tensor(v, dtype=torch.float32, device=device)

    def _straggler(self, change: Any) -> None:
        """A straggler found or gone: rank 0 says so and records it; the straggler's own node
        (its local rank 0) tells its agent, which may evict it (``--stragglers evict``)."""
        p = self.progress
        assert self._watch is not None
        if change[0] == "started":
            s = change[1]
            slow, node, text = True, s["node"], stragglers.started_text(s, self._watch.window)
            record = dict(s, slow=True)
        else:
            _, node, slowdown = change
            slow, text = False, stragglers.ended_text(node, slowdown)
            record = {"slow": False, "node": node, "ranks": [], "slowdown": slowdown or 0.0}
        if self.rank == 0:
            print(text, flush=True)
            self._records.write(0, "straggler", rank=0, step=p["global_step"], **record)
        mine = node == self._node
        if mine and os.environ.get("LOCAL_RANK", "0") == "0" and self.control is not None:
            try:
                self.control.send(ctl.straggler(slow, text))
            except ctl.ControlError:
                # A broken channel shows when the worker next needs it.
                pass

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        self.stop_requested = True

    def _on_uncaught(self, kind: Any, value: BaseException, tb: Any) -> None:
        self._excepthook(kind, value, tb)
        if (
            self.control is not None
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
            _membership.teardown(self)
        except Exception:  # noqa: BLE001 - the process ends either way
            pass

    # --- files ---------------------------------------------------------------------------------

    def _checkpoint(self, force: bool = False) -> None:
        """Rank 0 (or, with ``force``, the rank a stop chose) writes the state all ranks hold."""
        if self.rank != 0 and not force:
            return
        _state.write_checkpoint(self)
        self._records.checkpoint(self)


def _run_id(launched: bool) -> str:
    """The launcher's run id, or ``local`` for a one-node run whose id torchrun makes anew at
    every launch (a UUID) and for a run with no launcher, as ``trainctl run`` names it."""
    given = os.environ.get("TORCHELASTIC_RUN_ID", "") if launched else ""
    if not given or _UUID.match(given):
        return "local"
    return given


def _refuse_at_start(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any) -> None:
    # Before the group check: the other job's group is the one initialized.
    if _guards.live_job() is not None:
        raise UsageError(
            "a second Elastic was made in this process while the first one trains: one job per "
            "process (give the first one everything, or call job.finish() on it first)"
        )
    if isinstance(model, DistributedDataParallel):
        raise UsageError(
            "Elastic was given a DistributedDataParallel model: give it the model itself; "
            "job.model is the model wrapped in DDP, wrapped again after each regroup"
        )
    if dist.is_available() and dist.is_initialized():
        raise UsageError(
            "a process group is already initialized: Elastic starts (and restarts) the group "
            "itself; remove your dist.init_process_group(...)"
        )
    _guards.refuse_foreign_parameters(model, optimizer)
    _guards.refuse_stray_scheduler(optimizer, scheduler)
