"""The Hugging Face ``Trainer``, elastic under ``trainctl run``: change one import::

    from trainctl.hf import Trainer, TrainingArguments   # instead of: from transformers import ...

and a lost node costs the survivors the step in flight, a joining node takes the model, the
optimizer, the LR scheduler and the trainer's place from a peer, no worker restarts, and each
epoch's sample digest proves every sample was trained once, at any world size. Under plain
``torchrun`` or alone it trains as the Trainer does, and resumes from its checkpoint at the
exact sample.

How: ``Trainer.train()`` keeps everything of the Trainer's but its inner loop (model set-up,
optimizer and scheduler creation, ``compute_loss``, ``training_step``, callbacks, logging,
evaluation and saving are the Trainer's), which is ``trainctl.torch.Elastic``'s: the epoch's
order is the Trainer's own (``torch.randperm`` seeded by ``data_seed`` or ``seed`` + epoch,
split over the ranks in blocks as accelerate splits it), re-sharded from where the ranks stand
after a regroup. With nothing failing it trains what the stock Trainer trains.

``TrainingArguments`` keeps accelerate to one process's view: the process group is the job's,
started again at each regroup, which accelerate's fixed world cannot follow. So an evaluation
runs whole on every rank (the same metrics everywhere), and only rank 0 saves and logs.

Refused, with what to do: DeepSpeed, FSDP, an ``IterableDataset``, ``dataloader_drop_last``,
an ordering ``train_sampling_strategy``, ``resume_from_checkpoint`` (the job resumes from its
own checkpoint) and the stock ``TrainingArguments``; see docs/HUGGINGFACE.md in the trainctl
repository.
"""

from __future__ import annotations

import functools
import math
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import transformers

from .torch import Elastic, UsageError

# The names a launcher gives a worker its place by; hidden from accelerate (see above).
_PLACE = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


class TrainingArguments(transformers.TrainingArguments):
    """``transformers.TrainingArguments`` whose accelerate state is one process's: the process
    group is the job's (``trainctl.torch.Elastic`` starts it, again at every regroup), which
    accelerate's fixed world cannot follow. The process's rank (``process_index``: only rank 0
    saves and logs) and its device (``cuda:LOCAL_RANK``) are its own."""

    @functools.cached_property
    def _setup_devices(self) -> torch.device:
        hidden = {k: os.environ.pop(k) for k in _PLACE if k in os.environ}
        try:
            device = transformers.TrainingArguments._setup_devices.func(self)  # type: ignore[attr-defined]
        finally:
            os.environ.update(hidden)
        from accelerate.state import PartialState  # type: ignore[import-untyped]

        state = PartialState._shared_state
        local = int(hidden.get("LOCAL_RANK", "0"))
        state["process_index"] = int(hidden.get("RANK", "0"))
        state["local_process_index"] = local
        if device.type == "cuda":
            device = torch.device("cuda", local)
            state["device"] = device
            torch.cuda.set_device(device)
            self._n_gpu = 1
        return device


class Trainer(transformers.Trainer):
    """``transformers.Trainer`` whose training loop regroups in place (see the module's doc).
    Its arguments are the Trainer's; ``trainctl_options`` (a dict) goes to ``Elastic``
    (``checkpoint_every``, ``out``: the job's files, by default ``TrainingArguments.output_dir``)."""

    def __init__(
        self,
        model: Any = None,
        args: Any = None,
        *rest: Any,
        trainctl_options: dict[str, Any] | None = None,
        **kwargs: Any,
    ):
        if args is None:
            args = TrainingArguments(output_dir="trainer_output")
        if not isinstance(args, TrainingArguments):
            raise UsageError(
                f"Trainer was given {type(args).__module__}.{type(args).__name__}: use "
                "trainctl.hf.TrainingArguments (the same arguments), whose accelerate state leaves "
                "the process group to the job, which starts it again at every regroup"
            )
        # Before the Trainer's own checks, which ask a stream for max_steps.
        _refuse_a_stream(kwargs.get("train_dataset", rest[1] if len(rest) > 1 else None))
        super().__init__(model, args, *rest, **kwargs)
        self.trainctl_options = dict(trainctl_options or {})
        _refuse_unsupported(self)
        self.job: Elastic | None = None

    def train(self, resume_from_checkpoint: Any = None, *rest: Any, **kwargs: Any) -> Any:
        """The Trainer's ``train()``, its inner loop the job's; ``resume_from_checkpoint`` is
        refused (the job resumes from its own checkpoint)."""
        if resume_from_checkpoint not in (None, False):
            raise UsageError(
                f"train(resume_from_checkpoint={resume_from_checkpoint!r}): the job resumes from "
                "its own checkpoint (OUTPUT_DIR/RUN_ID/checkpoint.pt) at the exact sample, at any "
                "world size; the Trainer's checkpoints resume by a count of batches, which loses or "
                "repeats samples when the world size changed. Drop resume_from_checkpoint"
            )
        return super().train(None, *rest, **kwargs)

    # --- the loop --------------------------------------------------------------------------

    def _inner_training_loop(
        self,
        batch_size: int | None = None,
        args: Any = None,
        resume_from_checkpoint: str | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
    ) -> Any:
        args = args or self.args
        dataset, collate = self._training_data()
        per_device, accumulate = args.per_device_train_batch_size, args.gradient_accumulation_steps
        world = int(os.environ.get("WORLD_SIZE", "1") or 1)
        schedule = _Schedule(self, len(dataset), max(world, 1))
        # The Trainer's mixed precision is accelerate's autocast around the model's forward.
        self.model_wrapped = self.accelerator.prepare_model(self.model)
        optimizer = self.create_optimizer()
        self.create_scheduler(num_training_steps=schedule.max_steps, optimizer=optimizer)
        assert self.model is not None
        options = {"out": args.output_dir, **self.trainctl_options}
        job = self.job = Elastic(
            self.model,
            optimizer,
            dataset_size=len(dataset),
            batch_size=per_device,
            accumulate=accumulate,
            seed=args.data_seed if args.data_seed is not None else args.seed,
            scheduler=self.lr_scheduler,
            scaler=getattr(self.accelerator, "scaler", None),
            state=schedule,
            on_resize=lambda old, new: schedule.resized(new),
            shard="blocks",
            **options,
        )
        loader = job.loader(dataset, collate_fn=collate, **self._loader_options(args))
        self._start_state(job, schedule, trial)
        self.control = self.callback_handler.on_train_begin(args, self.state, self.control)
        start = time.time()
        for epoch in job.epochs(schedule.epochs):
            self.control = self.callback_handler.on_epoch_begin(args, self.state, self.control)
            for inputs in loader:
                _follow_rank(self, job.rank)
                schedule.apply(job)
                self._micro_batch(job, inputs, (dataset, collate), epoch, trial, ignore_keys_for_eval, start)
                if self.control.should_training_stop or schedule.done(self.state.global_step):
                    break
            self.control = self.callback_handler.on_epoch_end(args, self.state, self.control)
            self._maybe_log_save_evaluate(
                self._tr_loss, None, job.model, trial, epoch, ignore_keys_for_eval, start,
                learning_rate=self._get_learning_rate(),
            )
            if self.control.should_training_stop or schedule.done(self.state.global_step):
                break
        job.finish()
        _follow_rank(self, job.rank)
        return self._finalize_training(trial, len(dataset) * schedule.epochs, start)

    def _micro_batch(
        self, job: Elastic, inputs: Any, data: tuple[Any, Any], epoch: int, trial: Any, ignore: Any, start: float
    ) -> None:
        """One micro-batch as the Trainer's ``_run_epoch`` trains it, inside ``job.step()``."""
        args = self.args
        with job.step() as step:
            if step.first:
                batches = job.step_batches()
                self.control = self.callback_handler.on_step_begin(args, self.state, self.control)
                self._items = self._count_items(job, inputs, batches, data)
                self.current_gradient_accumulation_steps = len(batches)
            with _world(self, job.world_size):
                loss = self.training_step(job.model, inputs, self._items)
            self._tr_loss = self._tr_loss + loss.detach()
            self.current_flos += self.floating_point_ops(inputs)
            if step.sync:
                self._grad_norm = None
                if args.max_grad_norm is not None and args.max_grad_norm > 0:
                    self._grad_norm = self.accelerator.clip_grad_norm_(job.module.parameters(), args.max_grad_norm)
                self.control = self.callback_handler.on_pre_optimizer_step(args, self.state, self.control)
        if not step.sync:
            self.control = self.callback_handler.on_substep_end(args, self.state, self.control)
            return
        if not step.applied:
            return
        self.control = self.callback_handler.on_optimizer_step(args, self.state, self.control)
        learning_rate = self._get_learning_rate()
        scheduler = self.lr_scheduler
        if scheduler is not None and not isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            scheduler.step()
        self.state.global_step = job.progress.global_step
        self.state.epoch = epoch + job.progress.position / len(data[0])
        self.control = self.callback_handler.on_step_end(args, self.state, self.control)
        self._maybe_log_save_evaluate(
            self._tr_loss, self._grad_norm, job.model, trial, epoch, ignore, start, learning_rate=learning_rate
        )

    # --- its parts -------------------------------------------------------------------------


    def _count_items(self, job: Elastic, first: Any, batches: list[list[int]], data: tuple[Any, Any]) -> Any:
        """``num_items_in_batch`` as the Trainer counts it (the step's label tokens, over every
        rank's micro-batches when ``average_tokens_across_devices``), or None where the Trainer
        counts none. The step's first micro-batch is the loader's; the others are read and
        collated again to count, only where the Trainer counts (it has them all at once)."""
        if not (self.model_accepts_loss_kwargs or self.compute_loss_func is not None):
            return None
        dataset, collate = data
        samples = [first] + [collate([dataset[i] for i in indices]) for indices in batches[1:]]
        items = self._get_num_items_in_batch(samples, self.args.device)
        if items is None or not self.args.average_tokens_across_devices or job.world_size == 1:
            return items
        # The Trainer gathers and sums it over its processes: the job's group is the world.
        total = torch.as_tensor(items, device=job.device).clone()
        dist.all_reduce(total)
        return total

    def _training_data(self) -> tuple[Any, Any]:
        """The training set and its collator, the model's unused columns removed as the
        Trainer's own DataLoader removes them."""
        dataset = self.train_dataset
        # A datasets.Dataset's module is imported already (never imported here).
        datasets = sys.modules.get("datasets")
        if datasets is not None and isinstance(dataset, datasets.Dataset):
            return self._remove_unused_columns(dataset, description="training"), self.data_collator
        return dataset, self._get_collator_with_removed_columns(self.data_collator, description="training")

    def _loader_options(self, args: Any) -> dict[str, Any]:
        options: dict[str, Any] = {
            "num_workers": args.dataloader_num_workers,
            "pin_memory": args.dataloader_pin_memory and torch.cuda.is_available(),
        }
        if args.dataloader_num_workers > 0:
            options["persistent_workers"] = args.dataloader_persistent_workers
            if args.dataloader_prefetch_factor is not None:
                options["prefetch_factor"] = args.dataloader_prefetch_factor
        return options

    def _start_state(self, job: Elastic, schedule: _Schedule, trial: Any) -> None:
        """The Trainer's bookkeeping for a loop that starts at the job's place (a resume, a
        joiner's first step): its state (logging, evaluation and saving intervals) as its own
        loop makes it, at the job's step."""
        self._init_training_state(schedule.max_steps, schedule.steps_per_epoch, schedule.epochs, None, trial)
        self.state.global_step = job.progress.global_step
        self.state.train_batch_size = self.args.per_device_train_batch_size
        self._tr_loss = torch.tensor(0.0, device=self.args.device)
        self._total_loss_scalar = 0.0
        self._globalstep_last_logged = self.state.global_step
        self._initial_global_step = self.state.global_step
        self._initial_num_input_tokens_seen = self.state.num_input_tokens_seen
        self._grad_norm = None
        self._items = None


class Seq2SeqTrainingArguments(TrainingArguments, transformers.Seq2SeqTrainingArguments):
    """``transformers.Seq2SeqTrainingArguments`` (generation in evaluation), with
    ``TrainingArguments``' accelerate state."""


class Seq2SeqTrainer(Trainer, transformers.Seq2SeqTrainer):
    """``transformers.Seq2SeqTrainer`` (an evaluation that generates) whose training loop
    regroups in place, as ``Trainer``'s."""


class _Schedule:
    """How long training runs, counted as the Trainer counts it: its ``max_steps`` when given
    (the updates the user asked for, whatever the world size), else the epochs' steps at the
    world size the job started with, counted again for the steps left when the world size
    changes (``resized``), so that the LR schedule ends with the last epoch. Every rank holds
    the same (given to ``Elastic`` as ``state=``: a joiner takes it from a peer), so the
    schedule's length never depends on when a rank came in."""

    def __init__(self, trainer: Trainer, dataset_size: int, world_size: int):
        self.trainer = trainer
        self.dataset_size = dataset_size
        args = trainer.args
        self.by_steps = args.max_steps > 0
        # A world size the schedule is to be counted again at, before the next step (0: none).
        self.resize_to = 0
        self.steps_per_epoch = self.per_epoch(world_size)
        if self.by_steps:
            self.max_steps = int(args.max_steps)
            self.epochs = -(-self.max_steps // self.steps_per_epoch)
        else:
            self.max_steps = math.ceil(args.num_train_epochs * self.steps_per_epoch)
            self.epochs = math.ceil(args.num_train_epochs)

    def per_epoch(self, world_size: int, position: int = 0) -> int:
        """Updates in an epoch (from ``position``) at ``world_size``, as the Trainer counts
        them: its DataLoader's batches per rank, in steps of ``gradient_accumulation_steps``."""
        args = self.trainer.args
        batches = -(-(self.dataset_size - position) // (args.per_device_train_batch_size * world_size))
        return max(-(-batches // args.gradient_accumulation_steps), 1)

    def done(self, global_step: int) -> bool:
        return self.by_steps and global_step >= self.max_steps

    def resized(self, new: int) -> None:
        """The world size changed (``on_resize``, on every rank, a joiner's first group
        included): an epoch-counted schedule is counted again at ``new`` before the next step
        (``apply``); a step-counted one keeps its length."""
        if not self.by_steps:
            self.resize_to = new

    def apply(self, job: Elastic) -> None:
        """Before a step: a resize pending, the schedule ends after the steps left, counted at
        the new world size from where the run stands (every rank at the same step)."""
        if not self.resize_to:
            return
        p, new = job.progress, self.resize_to
        left = self.per_epoch(new, p.position) if p.position < self.dataset_size else 0
        left += max(self.epochs - p.epoch - 1, 0) * self.per_epoch(new)
        self.max_steps, self.resize_to = p.global_step + left, 0
        self.trainer.state.max_steps = self.max_steps
        _retarget(self.trainer.lr_scheduler, self.max_steps)

    def state_dict(self) -> dict[str, int]:
        return {
            "max_steps": self.max_steps,
            "epochs": self.epochs,
            "steps_per_epoch": self.steps_per_epoch,
            "resize_to": self.resize_to,
        }

    def load_state_dict(self, saved: dict[str, int]) -> None:
        self.max_steps, self.epochs = int(saved["max_steps"]), int(saved["epochs"])
        self.steps_per_epoch, self.resize_to = int(saved["steps_per_epoch"]), int(saved["resize_to"])
        _retarget(self.trainer.lr_scheduler, self.max_steps)


def _retarget(scheduler: Any, max_steps: int) -> None:
    """The Trainer's schedules (``get_scheduler``'s) are a LambdaLR over a partial function of
    ``num_training_steps``: pointed at ``max_steps``, the length every rank holds."""
    for i, fn in enumerate(getattr(scheduler, "lr_lambdas", [])):
        if isinstance(fn, functools.partial) and "num_training_steps" in fn.keywords:
            keywords = {**fn.keywords, "num_training_steps": max_steps}
            scheduler.lr_lambdas[i] = functools.partial(fn.func, *fn.args, **keywords)


class _world:
    """accelerate's count of processes set to the job's world size while a training step
    runs: the Trainer's loss normalised over every rank's tokens multiplies by it."""

    def __init__(self, trainer: Trainer, world_size: int):
        self.states = _accelerate_states(trainer)
        self.world_size = world_size
        self.saved: list[Any] = []

    def __enter__(self) -> None:
        self.saved = [s.get("num_processes") for s in self.states]
        for s in self.states:
            s["num_processes"] = self.world_size

    def __exit__(self, *exc: Any) -> None:
        for s, saved in zip(self.states, self.saved):
            s["num_processes"] = saved


def _follow_rank(trainer: Trainer, rank: int) -> None:
    """accelerate's process index follows the job's rank: rank 0 saves and logs, and after its
    node is lost another rank is 0."""
    for state in _accelerate_states(trainer):
        state["process_index"] = rank


def _accelerate_states(trainer: Trainer) -> list[Any]:
    """accelerate's shared states: the Accelerator's and the processes' (``PartialState``)."""
    from accelerate.state import PartialState

    return [trainer.accelerator.state._shared_state, PartialState._shared_state]


def _refuse_unsupported(trainer: Trainer) -> None:
    """What the elastic loop cannot make exact, refused before training, saying what to do."""
    args = trainer.args
    if getattr(trainer, "is_deepspeed_enabled", False) or args.deepspeed:
        raise UsageError(
            "DeepSpeed shards the optimizer's state over a fixed world, which a regroup cannot "
            "re-shard: drop deepspeed= (trainctl.hf trains data-parallel, a whole model per rank)"
        )
    if getattr(trainer, "is_fsdp_enabled", False) or args.fsdp:
        raise UsageError(
            "FSDP shards the model over a fixed world, which a regroup cannot re-shard: drop fsdp= "
            "(trainctl.hf trains data-parallel, a whole model per rank)"
        )
    if args.dataloader_drop_last:
        raise UsageError(
            "dataloader_drop_last=True leaves an epoch's last samples out, which the job counts as "
            "samples every epoch trains once: drop it"
        )
    strategy = getattr(args, "train_sampling_strategy", "random")
    if strategy != "random":
        raise UsageError(
            f"train_sampling_strategy={strategy!r} orders the epoch its own way, and the job's order "
            "is the Trainer's random one, which it re-shards after a regroup: drop it"
        )
    _refuse_a_stream(trainer.train_dataset)


def _refuse_a_stream(dataset: Any) -> None:
    if isinstance(dataset, torch.utils.data.IterableDataset):
        raise UsageError(
            f"train_dataset is an IterableDataset ({type(dataset).__name__}): the job decides which "
            "samples each rank trains by their index, to re-shard an epoch when the group changes "
            "and prove every sample was trained once. Give a map-style dataset (a datasets.Dataset, "
            "or __getitem__ and __len__), not a stream"
        )
