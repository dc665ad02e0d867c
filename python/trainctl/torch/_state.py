"""A run's state as one object: what a joining rank receives from a peer and what the
checkpoint holds (model, optimizer, scheduler, GradScaler, the objects given as ``state=``
and where the run stands), its fingerprints for the safety net, its broadcast, and the
checkpoint file.

The checkpoint is written atomically (a temporary file, synced, renamed, the folder synced);
torch's zip format checksums each record, and it is read with ``weights_only=True``.
"""

from __future__ import annotations

import fcntl
import io
import os
from typing import Any, Callable

import torch
import torch.distributed as dist

from . import _check
from ._errors import UsageError
from ._group import say
from ._kept import Kept
from ._progress import Progress

FORMAT = "trainctl.torch/1"


class TrainingState:
    """See the module's doc. ``live``: this rank's state is one it trained (or took whole from
    a peer), not what a stream cut off half-way left."""

    def __init__(
        self,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        scaler: Any,
        kept: Kept,
        progress: Progress,
    ):
        self.module = module
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.scaler = scaler
        self.kept = kept
        self.progress = progress
        self.live = False
        # The weights' and the kept state's fingerprints as of the last check (`fingerprint`).
        self.weights_fp = 0
        self.kept_fps: dict[str, int] = {}

    # --- the modules' train/eval modes ----------------------------------------------------------

    def modes(self) -> Callable[[], int]:
        """Remembers the train/eval mode of every module of the model and of the kept state
        (an EMA's): the returned function puts back those that changed since, and says how
        many. An evaluation a lost peer interrupts has called ``model.eval()`` and never
        reaches its ``model.train()``: without this, the rank would train on in eval mode
        (batch norm on its running statistics, no dropout), unlike its peers."""
        modules = [self.module] + [obj for _, obj in self.kept.objects if isinstance(obj, torch.nn.Module)]
        held = [(m, m.training) for top in modules for m in top.modules()]

        def restore() -> int:
            changed = [m for m, training in held if m.training != training]
            for m, training in held:
                m.training = training
            return len(changed)

        return restore

    # --- what the safety net compares -----------------------------------------------------------

    def fingerprint(self) -> None:
        """The weights' and the kept state's fingerprints, for the next checks."""
        self.weights_fp = _check.fingerprint(self.module)
        self.kept_fps = self.kept.fingerprints()

    def counters(self) -> dict[str, Any]:
        """What every rank must hold alike (``_check.counters``)."""
        return _check.counters(
            self.progress.global_step, self.weights_fp, self.kept_fps, self.optimizer, self.scheduler
        )

    def state_hash(self) -> int:
        return _check.state_hash(self.counters())

    def agree_at_end(self, rank: int, world_size: int, device: torch.device) -> None:
        """The run's end, in a group of ``world_size``: every rank past its last collective
        before any tears the group down (a group torn down under a peer's gloo thread can abort
        that process), the weights compared one last time, and rank 0's buffers (batch norm's
        running statistics, which DDP sends from rank 0 at each forward) made every rank's:
        whichever rank saves the model saves the same one."""
        self.fingerprint()
        mine = torch.tensor([self.state_hash()], dtype=torch.int64, device=device)
        everyone = [torch.zeros_like(mine) for _ in range(world_size)]
        try:
            dist.all_gather(everyone, mine)
            for b in self.module.buffers():
                dist.broadcast(b.data, src=0)
        except Exception:  # noqa: BLE001 - at the end, a peer gone changes nothing
            return
        _check.compare([int(t.item()) for t in everyone], "at the end of the run", rank, self.counters)

    # --- what travels ---------------------------------------------------------------------------

    def saved(self, resumed: bool) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "resumed": bool(resumed),
            "progress": self.progress.to_dict(),
            "model": self.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "user": self.kept.state_dict(),
        }

    def load(self, saved: dict[str, Any]) -> None:
        # In place: the façade and its parts hold this one object.
        loaded = Progress.from_dict(saved["progress"])
        for name, value in loaded.to_dict().items():
            setattr(self.progress, name, value)
        self.module.load_state_dict(saved["model"])
        self.optimizer.load_state_dict(saved["optimizer"])
        if self.scheduler is not None and saved.get("scheduler") is not None:
            self.scheduler.load_state_dict(saved["scheduler"])
        if self.scaler is not None and saved.get("scaler") is not None:
            self.scaler.load_state_dict(saved["scaler"])
        self.kept.load_state_dict(saved.get("user"))

    def broadcast(self, source: int, rank: int, device: torch.device, resumed: bool) -> tuple[int, bool]:
        """Rank ``source``'s state to every rank of the group: its size, then one
        ``torch.save`` blob. Returns (bytes, whether the state was resumed from a checkpoint)."""
        if rank == source:
            buf = io.BytesIO()
            torch.save(self.saved(resumed), buf)
            blob = buf.getvalue()
            size = torch.tensor([len(blob)], dtype=torch.int64, device=device)
        else:
            size = torch.zeros(1, dtype=torch.int64, device=device)
        dist.broadcast(size, src=source)
        n = int(size.item())
        if rank == source:
            data = torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(device)
        else:
            data = torch.empty(n, dtype=torch.uint8, device=device)
        dist.broadcast(data, src=source)
        if rank == source:
            return n, resumed
        received = torch.load(io.BytesIO(data.cpu().numpy().tobytes()), map_location="cpu", weights_only=True)
        self.load(received)
        return n, bool(received["resumed"])

    # --- the checkpoint -------------------------------------------------------------------------

    def write_checkpoint(self, path: str, if_newer: bool = False) -> bool:
        """The state this rank holds, to ``path``, whole or not at all. ``if_newer``: only
        when the file holds an earlier step (several ranks may each hold the job's state, and
        the furthest of them must win: ``regroup.saver_while_waiting``), under a lock beside
        it. Returns whether it wrote."""
        path = os.path.abspath(path)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if not if_newer:
            self._write(path)
            return True
        with open(f"{path}.lock", "a") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            held = saved_step(path)
            if held is not None and held >= self.progress.global_step:
                return False
            self._write(path)
            return True

    def _write(self, path: str) -> None:
        write_atomically(path, self.saved(False))

    def read_checkpoint(self, path: str) -> bool:
        """Loads ``path`` when it exists; a file that is not the package's is refused, saying
        how to start from it."""
        if not os.path.isfile(path):
            return False
        try:
            saved = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - say which file and why
            raise RuntimeError(f"{path}: cannot resume from it ({e}); move it away to start afresh") from None
        if not isinstance(saved, dict) or saved.get("format") != FORMAT:
            keys = ", ".join(sorted(map(str, saved))[:6]) if isinstance(saved, dict) else type(saved).__name__
            raise UsageError(
                f"{path} is not a trainctl.torch checkpoint (it holds {keys}): to start from a "
                "checkpoint of your own, load it into the model and optimizer (and scheduler) before "
                "Elastic(...) and pass start_epoch=THE_EPOCH_IT_REACHED; give Elastic a checkpoint "
                "path of its own, or move this file away"
            )
        self.load(saved)
        p = self.progress
        say(f"resuming from {path}: epoch {p.epoch + 1}, step {p.global_step}")
        return True


def write_atomically(path: str, saved: Any) -> None:
    """``torch.save(saved)`` to ``path``, whole or not at all: a temporary file beside it,
    synced, renamed over it, the folder synced (torch's zip format checksums each record)."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        torch.save(saved, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dirfd = os.open(os.path.dirname(path), os.O_RDONLY)
    try:
        os.fsync(dirfd)
    finally:
        os.close(dirfd)


def saved_step(path: str) -> int | None:
    """The global step the checkpoint at ``path`` holds (its tensors mapped, not read), or
    None when there is none that can be read."""
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        return int(saved["progress"]["global_step"])
    except Exception:  # noqa: BLE001 - no file, or not one of ours: nothing held
        return None
