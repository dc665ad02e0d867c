"""What a rank writes for its reader: its metrics file (``OUT/RUN_ID/metrics/rank-N.jsonl``,
the built-in trainer's records, which ``trainctl report`` draws) and rank 0's loss and epoch
lines."""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

import torch

from ..records import SCHEMA_VERSION, Metrics

if TYPE_CHECKING:
    from ._elastic import Elastic, Step

VERSION = "0.2.0"


class Records:
    def __init__(self, run_dir: str, print_freq: int):
        self.run_dir = run_dir
        self.print_freq = print_freq
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

    def start(self, job: Elastic) -> None:
        group = job.optimizer.param_groups[0]
        self.write(
            job.rank,
            "start",
            v=SCHEMA_VERSION,
            rank=job.rank,
            world_size=job.world_size,
            restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            step=job.progress["global_step"],
            resumed=bool(job._synced["resumed"]),
            from_peer=bool(job._synced["received"]),
            config={
                "run_id": job.run_id,
                "epochs": job.epochs_total,
                "batch_size": job.batch_size,
                "learning_rate": float(group.get("lr", 0.0)),
                "momentum": float(group.get("momentum", 0.0) or 0.0),
                "weight_decay": float(group.get("weight_decay", 0.0) or 0.0),
                "seed": job.seed,
                "threads": torch.get_num_threads(),
                "checkpoint_every": job.checkpoint_every,
                "data": str(job.config.get("data", "")),
                "backend": f"pytorch-{job.backend}",
                "version": f"trainctl.torch {VERSION}, torch {torch.__version__}",
                "model": str(job.config.get("model", type(job.module).__name__)),
                "image_size": int(job.config.get("image_size", 0)),
            },
        )

    def step(self, job: Elastic, step: Step, slowdown: float | None) -> None:
        """The step just applied: its record, and every ``print_freq`` steps rank 0's loss line."""
        p = job.progress
        assert job._epoch_mark is not None
        now = time.monotonic()
        seconds = now - step.started
        iter_ = p["global_step"] - job._epoch_mark[2]
        per_step = job.batch_size * job.accumulate * job.world_size
        steps_in_epoch = iter_ + -(-max(job.dataset_size - p["position"], 0) // per_step)
        loss = float(step.loss) if step.loss is not None else 0.0
        batch = job._step_samples
        images = batch * job.world_size
        correct = float(step.correct) if step.correct is not None else 0.0
        self.write(
            job.rank,
            "step",
            rank=job.rank,
            world_size=job.world_size,
            restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            epoch=p["epoch"] + 1,
            step=p["global_step"],
            iter=iter_,
            steps_in_epoch=steps_in_epoch,
            loss=loss,
            accuracy=correct / max(batch, 1),
            lr=float(job.optimizer.param_groups[0].get("lr", 0.0)),
            images=images,
            images_per_sec=images / max(seconds, 1e-9),
            step_s=seconds,
            data_s=step.data_s,
            compute_s=seconds,
            allreduce_s=0.0,
            **({"slowdown": slowdown} if slowdown is not None else {}),
        )
        if not self._window:
            self._window_started = step.started
        self._window.append((loss, images))
        if job.rank == 0 and self.print_freq and iter_ % self.print_freq == 0:
            mean = sum(x for x, _ in self._window) / len(self._window)
            elapsed = now - self._window_started
            print(
                f"[{p['epoch'] + 1}, {iter_:5d}] loss: {mean:.3f}  ({iter_}/{steps_in_epoch} steps, "
                f"{sum(n for _, n in self._window) / max(elapsed, 1e-9):.1f} images/s)",
                flush=True,
            )
            self._window = []

    def epoch(self, job: Elastic, seconds: float) -> None:
        """The epoch's batches all trained: the digest proves each sample was trained once."""
        p = job.progress
        self.write(
            job.rank,
            "epoch",
            rank=job.rank,
            epoch=p["epoch"] + 1,
            step=p["global_step"],
            seconds=seconds,
            samples_digest=f"{p['epoch_digest']:016x}",
        )
        if job.rank == 0:
            total = f" of {job.epochs_total}" if job.epochs_total else ""
            print(f"epoch {p['epoch']} done ({p['epoch'] + 1}{total}) in {seconds:.1f} s", flush=True)

    def checkpoint(self, job: Elastic) -> None:
        p = job.progress
        self.write(job.rank, "checkpoint", rank=job.rank, step=p["global_step"], epoch=p["epoch"], position=p["position"])
