"""What a rank writes for its reader: its metrics file (``OUT/RUN_ID/metrics/rank-N.jsonl``,
the built-in trainer's records, which ``trainctl report`` draws) and rank 0's loss and epoch
lines."""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from typing import Any

from ..records import SCHEMA_VERSION, Metrics
from ._progress import Progress

VERSION = "0.2.0"

# A run id that torchrun makes anew at every launch (--standalone, or one node without an
# endpoint): a relaunch would not find its checkpoint under it.
_UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


def run_id(launched: bool) -> str:
    """The launcher's run id, or ``local`` for a one-node run whose id torchrun makes anew at
    every launch (a UUID) and for a run with no launcher, as ``trainctl run`` names it."""
    given = os.environ.get("TORCHELASTIC_RUN_ID", "") if launched else ""
    if not given or _UUID.match(given):
        return "local"
    return given


@dataclass(frozen=True)
class Shape:
    """What sizes a run's steps: samples per rank per micro-batch, micro-batches per step, the
    data set's size."""

    batch_size: int
    accumulate: int
    dataset_size: int


@dataclass(frozen=True)
class Done:
    """A step just applied, for its record."""

    started: float
    """When its first micro-batch began (monotonic)."""
    data_s: float
    """How long the loop took to bring that micro-batch."""
    epoch_first_step: int
    """The global step before the epoch's first step (the epoch's counter runs from it)."""
    samples: int
    """This rank's samples in the step."""
    lr: float
    loss: Any
    correct: Any
    slowdown: float | None


class Records:
    def __init__(self, run_dir: str, print_freq: int, shape: Shape):
        self.run_dir = run_dir
        self.print_freq = print_freq
        self.shape = shape
        self._file: Metrics | None = None
        self._rank = -1
        # The steps since the last loss line: (loss, images), and when the first began.
        self._window: list[tuple[float, int]] = []
        self._window_started = 0.0

    def write(self, file_rank: int, kind: str, /, **fields: Any) -> None:
        """A record in rank ``file_rank``'s file (a regroup may give this worker another
        rank)."""
        if self._file is None or self._rank != file_rank:
            self.close()
            self._file, self._rank = Metrics(self.run_dir, file_rank), file_rank
        self._file.write(kind, **fields)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def start(self, rank: int, world_size: int, step: int, resumed: bool, from_peer: bool, config: dict[str, Any]) -> None:
        self.write(
            rank,
            "start",
            v=SCHEMA_VERSION,
            rank=rank,
            world_size=world_size,
            restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            step=step,
            resumed=resumed,
            from_peer=from_peer,
            config=config,
        )

    def step(self, rank: int, world_size: int, progress: Progress, done: Done) -> None:
        """The step just applied (``done``): its record, and every ``print_freq`` steps rank
        0's loss line."""
        p, shape = progress, self.shape
        now = time.monotonic()
        seconds = now - done.started
        iter_ = p.global_step - done.epoch_first_step
        per_step = shape.batch_size * shape.accumulate * world_size
        steps_in_epoch = iter_ + -(-max(shape.dataset_size - p.position, 0) // per_step)
        loss = float(done.loss) if done.loss is not None else 0.0
        batch = done.samples
        images = batch * world_size
        correct = float(done.correct) if done.correct is not None else 0.0
        self.write(
            rank,
            "step",
            rank=rank,
            world_size=world_size,
            restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            epoch=p.epoch + 1,
            step=p.global_step,
            iter=iter_,
            steps_in_epoch=steps_in_epoch,
            loss=loss,
            accuracy=correct / max(batch, 1),
            lr=done.lr,
            images=images,
            images_per_sec=images / max(seconds, 1e-9),
            step_s=seconds,
            data_s=done.data_s,
            compute_s=seconds,
            allreduce_s=0.0,
            **({"slowdown": done.slowdown} if done.slowdown is not None else {}),
        )
        if not self._window:
            self._window_started = done.started
        self._window.append((loss, images))
        if rank == 0 and self.print_freq and iter_ % self.print_freq == 0:
            mean = sum(x for x, _ in self._window) / len(self._window)
            elapsed = now - self._window_started
            print(
                f"[{p.epoch + 1}, {iter_:5d}] loss: {mean:.3f}  ({iter_}/{steps_in_epoch} steps, "
                f"{sum(n for _, n in self._window) / max(elapsed, 1e-9):.1f} images/s)",
                flush=True,
            )
            self._window = []

    def epoch(self, rank: int, progress: Progress, seconds: float, epochs_total: int) -> None:
        """The epoch's batches all trained: the digest proves each sample was trained once."""
        p = progress
        self.write(
            rank,
            "epoch",
            rank=rank,
            epoch=p.epoch + 1,
            step=p.global_step,
            seconds=seconds,
            samples_digest=f"{p.epoch_digest:016x}",
        )
        if rank == 0:
            total = f" of {epochs_total}" if epochs_total else ""
            print(f"epoch {p.epoch} done ({p.epoch + 1}{total}) in {seconds:.1f} s", flush=True)

    def checkpoint(self, rank: int, progress: Progress) -> None:
        p = progress
        self.write(rank, "checkpoint", rank=rank, step=p.global_step, epoch=p.epoch, position=p.position)


def run_config(
    run_id: str,
    epochs: int,
    shape: Shape,
    optimizer: Any,
    seed: int,
    checkpoint_every: int | None,
    backend: str,
    model: Any,
    given: dict[str, Any],
) -> dict[str, Any]:
    """The start record's `config`: the built-in trainer's fields, from the loop's objects and
    what it gave as ``config=`` (its data, model name, image size)."""
    import torch

    group = optimizer.param_groups[0]
    return {
        "run_id": run_id,
        "epochs": epochs,
        "batch_size": shape.batch_size,
        "learning_rate": float(group.get("lr", 0.0)),
        "momentum": float(group.get("momentum", 0.0) or 0.0),
        "weight_decay": float(group.get("weight_decay", 0.0) or 0.0),
        "seed": seed,
        "threads": torch.get_num_threads(),
        "checkpoint_every": checkpoint_every,
        "data": str(given.get("data", "")),
        "backend": f"pytorch-{backend}",
        "version": f"trainctl.torch {VERSION}, torch {torch.__version__}",
        "model": str(given.get("model", type(model).__name__)),
        "image_size": int(given.get("image_size", 0)),
    }
