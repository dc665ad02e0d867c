"""Lightning's ``Trainer``, elastic under ``trainctl run``: change one import::

    from trainctl.lightning import Trainer   # instead of: from lightning.pytorch import Trainer

and a job that loses a node, gains one or is told to stop goes on from the last step it
trained, at the exact sample, at any world size. Under plain ``torchrun`` it trains as
Lightning's DDP does (the same order, the same weights).

By an exact restart, not in place: Lightning 2's loops are private, and its strategy, its DDP
wrapper, its metric syncing and its checkpoint barriers hold one world for the Trainer's life.
So when the job's nodes change, ``trainctl run`` restarts every worker (as torchrun does) and
this Trainer resumes from its own checkpoint:

- The epoch's order is Lightning's (``DistributedSampler``'s: ``torch.randperm`` seeded by
  ``PL_GLOBAL_SEED`` + epoch, rank ``r`` taking every world-size-th sample), from a position
  that the checkpoint holds: a restart at another world size re-shards the rest of the epoch,
  and trains nothing twice and skips nothing.
- The checkpoint is Lightning's own (model, optimizers, LR schedulers, loops, callbacks) at a
  step boundary, written atomically to ``DEFAULT_ROOT_DIR/trainctl/``: every
  ``checkpoint_every`` optimizer steps by rank 0, and, when a step fails (a peer lost: its
  collective raises) or the job is stopped (SIGTERM: every rank stops after the same step), by
  every rank that can, of the last step it completed. A restart so trains again only the step
  in flight, or, when rank 0's node itself was lost mid-step and no other rank could write,
  the steps since the last scheduled checkpoint.
- At every epoch's end the ranks compare the samples trained (their digests) and their weights
  (a CRC-32): a mismatch stops the job (``DivergedError``, never retried).
- ``devices`` and ``num_nodes`` follow the job (``LOCAL_WORLD_SIZE``, ``WORLD_SIZE``): Lightning
  refuses a world it was not told of.

Refused, with what to do (``UsageError``, exit 76, never retried): a strategy other than DDP
(DeepSpeed, FSDP: their state is split by world size), manual optimization (several
optimizers, or steps of your own: the boundary between steps is yours), an ``IterableDataset``,
a custom sampler, ``drop_last``, several training dataloaders, ``limit_train_batches`` and
``overfit_batches`` (a part of an epoch), ``use_distributed_sampler=False``, a module of the
older ``pytorch_lightning`` package. See
docs/LIGHTNING.md in the trainctl repository.
"""

from __future__ import annotations

import copy
import fcntl
import os
import re
import sys
from typing import Any, Iterator

import torch
import torch.distributed as dist
from lightning.pytorch import Trainer as _LightningTrainer
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from lightning.pytorch.trainer.states import RunningStage
from torch.utils.data import DataLoader, IterableDataset, RandomSampler, SequentialSampler

from .sampler import Shard, digest
from .torch import DivergedError, UsageError
from .torch._check import fingerprint
from .torch._group import _route_interface
from .torch._state import write_atomically

EXIT_STOPPED = 143
"""A worker stopped by SIGTERM, its step checkpointed: what ``trainctl run`` expects of one."""


def say(message: str) -> None:
    print(f"trainctl.lightning: {message}", file=sys.stderr, flush=True)


class Trainer(_LightningTrainer):
    """``lightning.pytorch.Trainer`` that resumes exactly (see the module's doc). Its arguments
    are Lightning's, and ``checkpoint_every``: rank 0's scheduled checkpoint, in optimizer
    steps (100)."""

    def __init__(self, *args: Any, checkpoint_every: int = 100, **kwargs: Any):
        if checkpoint_every < 1:
            raise UsageError(f"checkpoint_every={checkpoint_every}: give a number of optimizer steps, 1 or more")
        _refuse_options(kwargs)
        _follow_the_job(kwargs)
        _choose_gloo_interface()
        self._exact = _Exact(checkpoint_every)
        kwargs["callbacks"] = [self._exact, *_as_list(kwargs.get("callbacks"))]
        super().__init__(*args, **kwargs)
        if type(self.strategy) not in (DDPStrategy, SingleDeviceStrategy):
            raise UsageError(
                f"strategy {type(self.strategy).__name__}: trainctl.lightning resumes Lightning's DDP "
                "only (DeepSpeed's and FSDP's state is split by world size); use strategy='ddp'"
            )
        overfit = getattr(self, "overfit_batches", 0)
        if self.limit_train_batches not in (1.0, None) or overfit:
            raise UsageError(
                f"limit_train_batches={self.limit_train_batches}, overfit_batches={overfit}: "
                "trainctl.lightning trains whole epochs; train a torch.utils.data.Subset of your "
                "dataset instead"
            )
        if not self._accelerator_connector.use_distributed_sampler:
            raise UsageError(
                "use_distributed_sampler=False: trainctl.lightning shards the training set itself, "
                "from where the job stands; leave use_distributed_sampler on"
            )
        prepare = self._data_connector._prepare_dataloader
        setattr(self._data_connector, "_prepare_dataloader",
                lambda loader, shuffle, mode: self._prepare(prepare, loader, shuffle, mode))
        # Lightning's own SIGTERM handler runs a broadcast inside the handler, which can pair
        # with the loop's collectives; setting the flag is enough: the loop broadcasts rank
        # 0's flag at every batch's start, so every rank stops after the same step.
        setattr(self._signal_connector, "_sigterm_notifier_fn", self._on_sigterm)

    def fit(self, model: Any, train_dataloaders: Any = None, val_dataloaders: Any = None,
            datamodule: Any = None, ckpt_path: Any = None, weights_only: bool | None = None) -> None:
        if any(c.__module__.startswith("pytorch_lightning") for c in type(model).__mro__):
            raise UsageError(
                f"{type(model).__name__} is a pytorch_lightning module: trainctl.lightning is "
                "Lightning's unified package; import LightningModule from lightning.pytorch"
            )
        if not model.automatic_optimization:
            raise UsageError(
                "automatic_optimization=False: trainctl.lightning resumes at a step boundary that "
                "Lightning's own optimization marks; with several optimizers or steps of your own, "
                "use trainctl.torch.Elastic in a loop of your own (docs/PYTORCH.md)"
            )
        own = self._exact.folder(self.default_root_dir).newest()
        if own is not None:
            instead = f", not ckpt_path={ckpt_path} (the job trained on from there)" if ckpt_path is not None else ""
            say(f"resuming from {own}{instead}")
            ckpt_path = own
        try:
            super().fit(model, train_dataloaders, val_dataloaders, datamodule, ckpt_path, weights_only)
        except BaseException as e:
            # A rank that had SIGTERM may stop a step before rank 0 says so: the others' next
            # step then fails, and they stop there too.
            if self.received_sigterm and not isinstance(e, (UsageError, DivergedError)):
                say("stopped by SIGTERM after a step; the same command resumes there")
                raise SystemExit(EXIT_STOPPED) from None
            raise

    def _prepare(self, prepare: Any, loader: Any, shuffle: bool, mode: RunningStage) -> Any:
        """Lightning's dataloader preparation, with the training set's sampler ours."""
        if mode != RunningStage.TRAINING:
            return prepare(loader, shuffle, mode)
        _refuse_loader(loader)
        from lightning.pytorch.utilities.data import _update_dataloader

        place = self.distributed_sampler_kwargs or {"num_replicas": 1, "rank": 0}
        sampler = _Sampler(
            self._exact,
            size=len(loader.dataset),
            shuffle=shuffle,
            seed=int(os.getenv("PL_GLOBAL_SEED", "0")),
            world_size=int(place["num_replicas"]),
            rank=int(place["rank"]),
            batch_size=int(loader.batch_size or 1),
            epoch=self.current_epoch,
        )
        return _update_dataloader(loader, sampler, mode=mode)

    def _on_sigterm(self, signum: Any, frame: Any) -> None:
        self._signal_connector.received_sigterm = True


class _Sampler(torch.utils.data.Sampler[int]):
    """This rank's share of an epoch in ``DistributedSampler``'s layout, from the position the
    job's checkpoint holds for that epoch (its start otherwise). Its length counts the batches
    the epoch trained before that position too, as Lightning's restored loop counts them."""

    def __init__(self, exact: _Exact, size: int, shuffle: bool, seed: int, world_size: int, rank: int,
                 batch_size: int, epoch: int):
        self.exact, self.size, self.shuffle, self.seed = exact, size, shuffle, seed
        self.world_size, self.rank, self.batch_size = world_size, rank, batch_size
        self.set_epoch(epoch)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        start, before = self.exact.resumed_at(epoch)
        self.shard = Shard(self.order(), start, self.world_size, self.rank, self.batch_size)
        self.before = before
        self.exact.begin(self)

    def order(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.size))
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        return torch.randperm(self.size, generator=g).tolist()

    def __iter__(self) -> Iterator[int]:
        return iter(self.shard.indices)

    def __len__(self) -> int:
        return self.before * self.batch_size + len(self.shard.indices)

    def consumed(self, batches: int) -> int:
        """The epoch's position once ``batches`` of this sampler's batches have trained."""
        return min(self.shard.start + batches * self.batch_size * self.world_size, self.size)

    def trained(self, batches: int) -> list[int]:
        """The samples this rank trained in its first ``batches`` batches (padding left out)."""
        return self.shard.indices[: min(batches * self.batch_size, self.shard.unpadded)]


class _Exact(Callback):
    """Where the job stands, at each step boundary: the epoch's position (in the checkpoint's
    callback state), Lightning's loop counters as they were then, and whether the optimizer
    has stepped since (the state is then between boundaries). Writes the job's checkpoints and
    checks each epoch's samples and weights."""

    def __init__(self, every: int):
        self.every = every
        self.restored: dict[str, int] | None = None  # the position a checkpoint held
        self.sampler: _Sampler | None = None
        self.batches = 0  # this sampler's batches trained
        self.at = 0  # ... by the last boundary
        self.boundary: dict[str, Any] | None = None  # fit loop's state at the last boundary
        self.buffers: dict[str, torch.Tensor] = {}  # ... and the module's buffers
        self.stepped = False
        self._folder: _Folder | None = None

    @property
    def state_key(self) -> str:
        return "trainctl.lightning"

    def folder(self, root: str) -> _Folder:
        self._folder = self._folder or _Folder(os.path.join(root, "trainctl"))
        return self._folder

    # The position.

    def resumed_at(self, epoch: int) -> tuple[int, int]:
        """(position, batches trained before it) in ``epoch`` by the checkpoint resumed."""
        r = self.restored
        if r is not None and r["epoch"] == epoch:
            return r["consumed"], r["batches"]
        return 0, 0

    def begin(self, sampler: _Sampler) -> None:
        self.sampler, self.batches, self.at = sampler, 0, 0

    def position(self) -> dict[str, int]:
        s = self.sampler
        if s is None:
            return dict(self.restored or {"epoch": 0, "consumed": 0, "batches": 0})
        return {"epoch": s.epoch, "consumed": s.consumed(self.at), "batches": s.before + self.at}

    def state_dict(self) -> dict[str, Any]:
        return self.position()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.restored = {k: int(state_dict[k]) for k in ("epoch", "consumed", "batches")}

    # The boundaries.

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        for optimizer in trainer.optimizers:
            optimizer.register_step_post_hook(self._stepped)

    def _stepped(self, *_: Any) -> None:
        self.stepped = True

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._user_reload = trainer.reload_dataloaders_every_n_epochs
        if trainer.fit_loop.restarted_mid_epoch and self.restored is None:
            raise UsageError(
                "ckpt_path: a checkpoint saved mid-epoch without trainctl.lightning holds no "
                "position in the epoch; resume from one saved at an epoch's end, or by trainctl.lightning"
            )

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        trainer.reload_dataloaders_every_n_epochs = self._user_reload

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.batches += 1
        if trainer.fit_loop.epoch_loop._should_accumulate():
            return
        # The boundary: model, optimizer and schedulers have taken this step, as when
        # Lightning's own ModelCheckpoint saves here. It stands until the next step's end (an
        # epoch's end hooks change the state only as a restart from here would skip them).
        self.boundary = copy.deepcopy(trainer.fit_loop.state_dict())
        # The next step's forward updates the buffers (BatchNorm's statistics) before its
        # all-reduce can fail: they are kept as they were here (small beside the weights).
        self.buffers = {name: b.detach().clone() for name, b in pl_module.named_buffers()}
        self.at = self.batches
        self.stepped = False
        if trainer.is_global_zero and trainer.global_step % self.every == 0:
            self.write(trainer)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self._check_epoch(trainer, pl_module)
        resumed = self.sampler is not None and self.sampler.shard.start > 0
        # The next epoch's batches differ in number from this resumed one's: Lightning counts
        # them again only with a fresh dataloader.
        trainer.reload_dataloaders_every_n_epochs = 1 if resumed else self._user_reload
        self.restored = None

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if isinstance(exception, (UsageError, DivergedError)) or self.boundary is None:
            return
        # Rank 0 writes; so does the first rank of the next node, in case rank 0's node is the
        # one lost (not on SIGTERM: a node told to go alone fails the others' next step).
        second = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        if not (trainer.global_rank == 0 or (trainer.global_rank == second and not trainer.received_sigterm)):
            return
        if self.stepped:
            say("not checkpointed: the step failed after the optimizer stepped; the restart goes back to the last checkpoint")
            return
        self.write(trainer, why="on SIGTERM" if trainer.received_sigterm else f"after {type(exception).__name__}")

    def write(self, trainer: Any, why: str = "") -> None:
        """Lightning's checkpoint, its loops as they were at the last boundary."""
        assert self.boundary is not None
        checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        checkpoint["loops"]["fit_loop"] = self.boundary
        weights = checkpoint["state_dict"]
        weights.update({name: b for name, b in self.buffers.items() if name in weights})
        step = int(checkpoint["global_step"])
        wrote = self.folder(trainer.default_root_dir).write(step, trainer.global_rank, checkpoint)
        if why:
            say(f"checkpointed step {step} {why}" if wrote else f"step {step} is checkpointed already ({why})")

    # The safety net.

    def _check_epoch(self, trainer: Any, pl_module: Any) -> None:
        """The samples every rank trained in the epoch, added, are the epoch's first ones, each
        once (all of them unless training ends in this epoch), and every rank holds the same
        weights; rank 0 says so. One all-gather an epoch."""
        s = self.sampler
        if s is None:
            return
        order = s.order()
        whole = self.batches >= s.shard.steps
        if not whole and not (trainer.should_stop or _max_steps_reached(trainer)):
            raise DivergedError(
                f"epoch {s.epoch + 1} ended after {self.batches} of its {s.shard.steps} batches on rank "
                f"{trainer.global_rank}, with training not over; the job stops"
            )
        mine = digest(s.trained(self.batches))
        crc = fingerprint(pl_module)
        row = torch.tensor([mine & 0xFFFFFFFF, mine >> 32, crc], dtype=torch.int64)
        rows = [row]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            rows = [torch.zeros_like(row) for _ in range(dist.get_world_size())]
            dist.all_gather(rows, row)
        before = digest(order[: s.shard.start])
        total = (before + sum(int(r[0]) | (int(r[1]) << 32) for r in rows)) & ((1 << 64) - 1)
        expected = digest(order[: s.consumed(self.batches)])
        if total != expected:
            raise DivergedError(
                f"epoch {s.epoch + 1}: the samples trained are not the epoch's first "
                f"{s.consumed(self.batches)}, each once (digest {total:016x}, expected {expected:016x}); "
                "the job stops"
            )
        weights = {int(r[2]) for r in rows}
        if len(weights) > 1:
            raise DivergedError(f"epoch {s.epoch + 1}: the ranks' weights differ ({sorted(weights)}); the job stops")
        if trainer.is_global_zero:
            trained = f"{s.size} samples trained once each" if whole else f"{s.consumed(self.batches)} of {s.size} samples trained once each"
            say(f"epoch {s.epoch + 1}: {trained} (world size {s.world_size}), weights {crc:08x}")


def _max_steps_reached(trainer: Any) -> bool:
    return trainer.max_steps != -1 and trainer.global_step >= trainer.max_steps


class _Folder:
    """The job's checkpoints: ``step-SSSSSSSSSS-rank-R.ckpt``, each written atomically
    (``write_atomically``), the newest step kept. Two ranks may write a step: rank 0's copy (its BatchNorm
    statistics are the ones DDP spreads) is read first."""

    NAME = re.compile(r"^step-(\d{10})-rank-(\d+)\.ckpt$")

    def __init__(self, path: str):
        self.path = path

    def held(self) -> list[tuple[int, int]]:
        """(step, -rank) of every checkpoint there, the one to read last."""
        try:
            names = os.listdir(self.path)
        except FileNotFoundError:
            return []
        return sorted((int(m.group(1)), -int(m.group(2))) for m in map(self.NAME.match, names) if m)

    def name(self, step: int, rank: int) -> str:
        return os.path.join(self.path, f"step-{step:010d}-rank-{rank}.ckpt")

    def newest(self) -> str | None:
        held = self.held()
        return self.name(held[-1][0], -held[-1][1]) if held else None

    def write(self, step: int, rank: int, checkpoint: dict[str, Any]) -> bool:
        """Writes ``checkpoint`` unless a newer one, or this step's by a lower rank, is there;
        removes the older steps; whether it wrote."""
        os.makedirs(self.path, exist_ok=True)
        with open(os.path.join(self.path, "lock"), "a") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            held = self.held()
            if held and held[-1] >= (step, -rank):
                return False
            write_atomically(self.name(step, rank), checkpoint)
            for old_step, old_rank in held:
                if old_step < step:
                    os.remove(self.name(old_step, -old_rank))
            return True


def _as_list(callbacks: Any) -> list[Any]:
    if callbacks is None:
        return []
    return list(callbacks) if isinstance(callbacks, (list, tuple)) else [callbacks]


def _follow_the_job(kwargs: dict[str, Any]) -> None:
    """``devices`` and ``num_nodes`` as the launcher placed this worker (Lightning checks their
    product against WORLD_SIZE, which changes as nodes come and go)."""
    world, local = os.environ.get("WORLD_SIZE"), os.environ.get("LOCAL_WORLD_SIZE")
    if world is None or local is None:
        return
    w, l = int(world), int(local)
    if w % l:
        raise UsageError(f"WORLD_SIZE {w} is not a multiple of LOCAL_WORLD_SIZE {l}: give every node the same --nproc-per-node")
    kwargs["devices"], kwargs["num_nodes"] = l, w // l


def _choose_gloo_interface() -> None:
    """gloo binds the address its host name resolves to, which another host may not reach
    (network namespaces, some containers): unless the user chose, the interface on the route
    to MASTER_ADDR, as trainctl.torch chooses it."""
    if "GLOO_SOCKET_IFNAME" in os.environ or "MASTER_ADDR" not in os.environ:
        return
    name = _route_interface(os.environ["MASTER_ADDR"])
    if name:
        os.environ["GLOO_SOCKET_IFNAME"] = name


def _refuse_options(kwargs: dict[str, Any]) -> None:
    strategy = kwargs.get("strategy")
    if isinstance(strategy, str) and any(k in strategy for k in ("deepspeed", "fsdp")):
        raise UsageError(
            f"strategy={strategy!r}: trainctl.lightning resumes Lightning's DDP only (DeepSpeed's "
            "and FSDP's state is split by world size); use strategy='ddp'"
        )


def _refuse_loader(loader: Any) -> None:
    """The training dataloader: one, map-style, sampled by Lightning, every sample kept."""
    if not isinstance(loader, DataLoader):
        raise UsageError(
            f"a training dataloader of type {type(loader).__name__}: trainctl.lightning shards one "
            "torch DataLoader; combine your datasets into one (torch.utils.data.ConcatDataset)"
        )
    if isinstance(loader.dataset, IterableDataset):
        raise UsageError(
            "an IterableDataset: a stream has no index to re-shard or count by; give a map-style "
            "dataset (__getitem__ and __len__)"
        )
    if loader.drop_last:
        raise UsageError(
            "DataLoader(drop_last=True): the samples dropped change with the world size; leave "
            "drop_last off (each rank's last batch may be smaller)"
        )
    if not isinstance(loader.sampler, (RandomSampler, SequentialSampler)):
        raise UsageError(
            f"a sampler of your own ({type(loader.sampler).__name__}): its order cannot be "
            "re-sharded from where the job stands; use shuffle=True (Lightning's order)"
        )
