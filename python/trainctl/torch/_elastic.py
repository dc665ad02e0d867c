"""``Elastic``: the training loop's face of the job (see the package's doc).

The loop's calls into the job are its *boundaries*: the batch iterator asking for the next
batch, ``job.epochs()`` asking for the next epoch, ``job.evaluate()`` and ``job.finish()``.
What a step's agreement decided (pause for a new round, stop, checkpoint) is carried out at
the next boundary, after the loop's own code between steps (its scheduler step, its logging)
has run on every rank: the state that then travels to a joiner or into the checkpoint is the
state a rank holds at the top of the next step, which is where a rank that starts the
program afresh comes in. A lost peer is handled at once: its collective failed, and the step
is dropped.

The façade holds the parts and says what happens when; each part knows only what it is given:
``TrainingState`` (what travels, the checkpoint), ``Membership`` (the group over time),
``Stepper`` and ``Agreement`` (a step), ``Inbox`` (the agent), ``Plan`` (the epoch's batches),
``Flow`` (a rank that came in mid-loop), ``Records``, ``Kept`` and ``Strays`` (what the loop
keeps). What the worker does at each turn is ``trainctl.regroup``'s, the protocol's tables
shared with the built-in trainer.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from .. import control as ctl
from .. import regroup, stragglers
from . import _check, _data, _guards
from . import _records as records
from ._epoch import Epoch
from ._errors import UsageError
from ._flow import Flow
from ._group import Group, detail, say, why
from ._inbox import Inbox
from ._kept import Kept
from ._membership import WARM_WORKER, Hooks, Membership, Place, Synced
from ._lifecycle import Exits
from ._progress import Progress
from ._records import Records, Shape, run_config
from ._state import TrainingState
from ._step import Step, Stepper
from ._strays import Strays

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
    - ``shard``: how a step's samples are split over the ranks: ``"interleaved"``
      (DistributedSampler's, the default) or ``"blocks"`` (accelerate's, as the Hugging Face
      Trainer trains them). Either way a step trains the same samples.

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
        shard: str = _data.INTERLEAVED,
    ):
        if dataset_size <= 0 or batch_size <= 0 or accumulate <= 0:
            raise ValueError(
                f"dataset_size {dataset_size}, batch_size {batch_size} and accumulate {accumulate}: "
                "each must be positive"
            )
        _guards.refuse_at_start(model, optimizer, scheduler)
        self.module, self.optimizer, self.scheduler, self.scaler = model, optimizer, scheduler, scaler
        self.shape = Shape(int(batch_size), int(accumulate), int(dataset_size))
        self.seed, self.checkpoint_every, self.config = int(seed), checkpoint_every, dict(config or {})
        self.ddp_options = dict(ddp or {})
        # Under a launcher (torchrun, trainctl run; started warm: no place in the job yet, the
        # first group waits for its round); otherwise a group of one.
        warm = os.environ.get(WARM_WORKER) == "1"
        launched = warm or "WORLD_SIZE" in os.environ
        self.run_id = run_id or records.run_id(launched)
        self.run_dir = os.path.join(out, self.run_id)
        self.checkpoint_path = checkpoint or os.path.join(self.run_dir, "checkpoint.pt")
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        local = int(os.environ.get("LOCAL_RANK", "0"))
        self.device = torch.device("cuda", local) if self.backend == "nccl" else torch.device("cpu")
        self.epochs_total = 0
        self.stop_requested = False
        self._started = False
        self.state = TrainingState(model, optimizer, scheduler, scaler, Kept(state), Progress(epoch=int(start_epoch)))
        self._place = Place(
            rank=int(os.environ.get("RANK", "0")) if launched else 0,
            world_size=int(os.environ.get("WORLD_SIZE", "0" if warm else "1")) if launched else 1,
            node=int(os.environ.get("GROUP_RANK", "0")),
        )
        self._flow = Flow()
        self._plan = _data.Plan(
            self.shape.dataset_size, self.seed, self.shape.batch_size, self.shape.accumulate, shard
        )
        self._records = Records(self.run_dir, print_freq, self.shape)
        self._strays = Strays(model)
        self.group = Group(self.backend, self.device, launched)
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_sigterm)
        self._hook = _guards.guard_all(
            lambda: self._stepper.stepping, self._after_update_may_run, self.state, self
        )
        self.inbox = Inbox.open(launched, self.group.on_message)
        hooks = Hooks(
            lambda: self._stepper.wrap(self.module, self.backend, self.device),
            lambda: self._stepper.unwrap(), self._save, lambda: self.stop_requested, on_resize,
        )
        self._membership = Membership(
            self.group, self.inbox, self.state, self._flow, self._records, self._place, hooks,
            self.device, self.shape.dataset_size, self.checkpoint_path,
        )
        watch = stragglers.Watch(straggler_factor, straggler_window) if straggler_window else None
        self._stepper = Stepper(
            self.state, self._place, self.group, self.inbox, self._membership, self._flow, self._records,
            self.shape, self.device, self.ddp_options, int(checkpoint_every or 0), watch,
            lambda: self._save(False), lambda: self.stop_requested,
        )
        self._epoch = Epoch(self._plan, self.state, self._place, self._stepper, self._flow, self._records, self._boundary)
        self._exits = Exits(self.group, self.inbox, self._membership.teardown)
        self._exits.install()
        m = self._membership
        self._synced: Synced = m.warm_start() if warm else m.first_start()

    # --- what the training loop uses ---------------------------------------------------------

    @property
    def model(self) -> torch.nn.Module:
        """The model to train: wrapped in ``DistributedDataParallel`` (again after a regroup),
        so read it inside each step, not once."""
        ddp = self._stepper.ddp
        return ddp if ddp is not None else self.module

    @property
    def rank(self) -> int:
        return self._place.rank

    @property
    def world_size(self) -> int:
        return self._place.world_size

    @property
    def progress(self) -> Progress:
        """Where the run stands (epoch, position, global step, samples seen)."""
        return self.state.progress

    def epochs(self, n: int) -> Iterator[int]:
        """The epochs left of ``n`` (0-based), from where the run stands."""
        self.epochs_total = self._epoch.total = int(n)
        if not self._started:
            self._started = True
            config = run_config(
                self.run_id, self.epochs_total, self.shape, self.optimizer, self.seed,
                self.checkpoint_every, self.backend, self.module, self.config,
            )
            p, synced = self.progress, self._synced
            self._records.start(self.rank, self.world_size, p.global_step, synced.resumed, synced.received, config)
        while self.progress.epoch < self.epochs_total:
            yield self.progress.epoch
            # After the loop's own code at the epoch's end; an epoch whose batches the loop
            # left before their end goes on.
            self._boundary()
            if self.progress.position >= self.shape.dataset_size:
                self._end_epoch()

    def batches(self) -> _data.Batches:
        """This rank's sample indices for each micro-batch left in the epoch, re-sharded from
        the position all ranks agree on after a regroup: iterate it, or give it to a DataLoader
        as ``batch_sampler`` (without worker processes: ``job.loader()`` has them). Train each
        inside ``with job.step():`` before asking for the next."""
        return _data.Batches(self._epoch)

    def loader(self, dataset: Any, **kwargs: Any) -> _data.Loader:
        """A DataLoader of ``dataset`` over this rank's batches of the rest of the epoch;
        ``kwargs`` are DataLoader's (``num_workers``, ``collate_fn``, ``pin_memory``,
        ``persistent_workers``, ...), not the batching, which is the job's. When the group
        changes, what its workers read ahead is dropped and loading goes on as the new group
        shards the epoch."""
        return _data.Loader(self._epoch, dataset, kwargs)

    def step_batches(self) -> list[list[int]]:
        """This rank's sample indices for each micro-batch of the step whose batch the loop
        holds now (all of them, the ones not loaded yet included: what a loss normalised over
        the step's samples counts); empty between steps."""
        handed = self._stepper.handed
        if handed is None:
            return []
        planned, i = self._epoch.current
        first = i - handed.part
        return [m.indices for m in planned[first : first + handed.parts]]

    def step(self) -> Step:
        """One micro-batch: the optimizer steps at the end of a step's last one, once every
        rank agreed the step is whole; a lost peer drops the step and the workers regroup in
        place (the block's exception is swallowed, and the loop goes on)."""
        return Step(self._stepper)

    def evaluate(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` between steps, with the collectives it runs made elastic: a
        peer lost meanwhile regroups the workers in place and ``fn`` runs again in the new
        group. A node joining or leaving at the step before waits until the next batch: the
        evaluation runs in the group that trained that step. Returns what ``fn`` returns, or
        None on the ranks that must skip it (rare; each skip is said): a rank that came into
        the group skips the evaluations the others made before it came in, and when a peer is
        lost in one and the new group has a newcomer, every rank skips it (``fn`` would wait
        for the newcomer, which is not there). When a lost peer interrupts ``fn``, the modules'
        train/eval modes are put back as they were before it (its ``model.train()`` never
        came)."""
        if self._stepper.in_step:
            raise UsageError(
                "job.evaluate() inside `with job.step():`: evaluate between steps (after the block, "
                "or after the epoch's batches)"
            )
        p = self.progress
        synced = self._boundary(pause_after=True)
        if p.epoch_end_evals >= 0:
            p.epoch_end_evals += 1
        if synced is not None and synced.fresh:
            return self._skip_evaluation("a node joined the group at this step")
        if not self._flow.evaluation_runs():
            return self._skip_evaluation("this rank came into the group after the others made it")
        while True:
            started = time.monotonic()
            modes = self.state.modes()
            try:
                return fn(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 - sorted below
                if not self._stepper.regroups(e, started):
                    raise
                # fn stopped midway: its model.eval() stays unless undone.
                modes()
                synced = self._membership.regroup(why(e), lost=True, detail=detail(e))
                if synced.fresh:
                    return self._skip_evaluation("a peer was lost while it ran, and a node joined the new group")

    def finish(self) -> None:
        """The run's end: every rank checks that all hold the same weights, says where it ended
        (its weights' fingerprint), and the group and the channel are closed."""
        self._boundary()
        if self.world_size > 1 and dist.is_initialized():
            self.state.agree_at_end(self.rank, self.world_size, self.device)
        # Training is over: the agent must not regroup or restart this worker when a peer goes
        # while the program's own end (saving, an evaluation) runs.
        self.inbox.send(ctl.finished())
        p = self.progress
        print(
            f"rank {self.rank} finished after {p.global_step} steps; weights fingerprint "
            f"{self.fingerprint():08x} (world size {self.world_size}, {p.samples_seen} samples trained in all)",
            flush=True,
        )
        self._membership.teardown()
        self.inbox.close()
        self._records.close()
        self._hook.remove()
        _guards.set_live(None)
        self._exits.uninstall()

    def fingerprint(self) -> int:
        """A CRC32 of the model's parameters and buffers: equal on ranks that hold the same."""
        return _check.crc32(self.module.state_dict().values())

    # --- the loop's boundaries -----------------------------------------------------------------

    def _boundary(self, pause_after: bool = False) -> Synced | None:
        """Carries out what the last step's agreement decided; with ``pause_after`` (an
        evaluation), a pause (a regroup, this node's leave) waits for the next boundary, so
        that the evaluation runs in the group that trained the step. Returns the new group's
        sync when it regrouped. First, what the loop changed in the kept state after a step
        that applied no update is undone, and the copies of the model it keeps are looked at."""
        stepper = self._stepper
        if stepper.diverged is not None:
            raise stepper.diverged
        undone = self.state.kept.undo()
        if undone:
            say(
                f"rank {self.rank}: the loop changed {', '.join(undone)} after a step that applied no "
                "update (a peer was lost and the step dropped); undone, so that it follows the updates "
                "the job applied. Change it only `if step.applied:` after `with job.step() as step:`"
            )
        self._strays.at_boundary(self.progress.global_step, self._strays_known())
        pending = stepper.pending
        if pending is None or pending.do is regroup.Do.CONTINUE:
            stepper.pending = None
            return None
        if pause_after and pending.do in (regroup.Do.REGROUP, regroup.Do.LEAVE):
            return None
        stepper.pending = None
        if pending.do is regroup.Do.CHECKPOINT:
            self._checkpoint()
        elif pending.do is regroup.Do.STOP:
            self._membership.stop(pending.saver)
        elif pending.do is regroup.Do.LEAVE:
            self._membership.leave()
        elif pending.do is regroup.Do.REGROUP:
            return self._membership.regroup("paused for a new round", lost=False, saver=self.rank == pending.saver)
        return None

    def _end_epoch(self) -> None:
        """After the loop's own code at the epoch's end (its evaluation, its scheduler step):
        the next epoch, its state checked and checkpointed."""
        if self.progress.epoch_end_evals < 0:
            self._epoch.batches_ended()
        self.progress.next_epoch()
        self._flow.reset()
        self.state.fingerprint()
        self._strays.at_epoch_end(self._strays_known())
        self._checkpoint()

    def _skip_evaluation(self, reason: str) -> Any:
        say(
            f"rank {self.rank} skips an evaluation ({reason}): job.evaluate() returns None here, so "
            "use its result only `if result is not None:` (the ranks that ran it have it)"
        )
        return None

    # --- what the parts ask of the job ---------------------------------------------------------

    def _after_update_may_run(self, what: str) -> bool:
        """Whether the loop's ``what`` (``scheduler.step()``, an AveragedModel's
        ``update_parameters()``) runs: only after a block that applied an update."""
        if self._stepper.in_step:
            raise UsageError(
                f"{what} inside `with job.step():`: the job steps the optimizer at the block's end, "
                f"so call {what} after the block (per step or per epoch), as PyTorch documents "
                "(after optimizer.step())"
            )
        return not self._flow.void

    def _checkpoint(self) -> None:
        """The scheduled checkpoint (an epoch's end, every ``checkpoint_every`` steps): rank 0
        writes the state every rank holds."""
        if self.rank == 0:
            self._save(False)

    def _save(self, if_newer: bool) -> None:
        """The checkpoint of the state this rank holds (the rank a decision named calls it)."""
        if self.state.write_checkpoint(self.checkpoint_path, if_newer):
            self._records.checkpoint(self.rank, self.progress)

    def _strays_known(self) -> list[Any]:
        known = [self._stepper.ddp, self.optimizer, self.scheduler, self.scaler, *self.state.kept.parts()]
        return [o for o in known if o is not None]

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        self.stop_requested = True
