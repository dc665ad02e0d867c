"""A run's state as one object: what a joining rank receives from a peer and what the
checkpoint holds (model, optimizer, scheduler, GradScaler, the objects given as ``state=``
and where the run stands), its broadcast, and the checkpoint file.

The checkpoint is written atomically (a temporary file, synced, renamed, the folder synced);
torch's zip format checksums each record, and it is read with ``weights_only=True``.
"""

from __future__ import annotations

import io
import os
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ._group import say
from ._errors import UsageError

if TYPE_CHECKING:
    from ._elastic import Elastic

FORMAT = "trainctl.torch/1"

# Where a run stands. Older checkpoints lack the later fields; they load with these values.
PROGRESS_DEFAULTS = {
    "epoch": 0,
    "position": 0,
    "global_step": 0,
    "samples_seen": 0,
    "epoch_digest": 0,
    # The world size this state was trained at (0: none yet); ``on_resize`` is told a change.
    "world_size": 0,
    # Calls of ``job.evaluate()`` since the epoch's batches ended (-1: they have not): a rank
    # that joins then skips as many (see ``Flow``).
    "epoch_end_evals": -1,
}


def state(job: Elastic, resumed: bool) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "resumed": bool(resumed),
        "progress": dict(job.progress),
        "model": job.module.state_dict(),
        "optimizer": job.optimizer.state_dict(),
        "scheduler": job.scheduler.state_dict() if job.scheduler is not None else None,
        "scaler": job.scaler.state_dict() if job.scaler is not None else None,
        "user": job.kept.state_dict(),
    }


def load(job: Elastic, saved: dict[str, Any]) -> None:
    job.progress = {k: int(saved["progress"].get(k, v)) for k, v in PROGRESS_DEFAULTS.items()}
    job.module.load_state_dict(saved["model"])
    job.optimizer.load_state_dict(saved["optimizer"])
    if job.scheduler is not None and saved.get("scheduler") is not None:
        job.scheduler.load_state_dict(saved["scheduler"])
    if job.scaler is not None and saved.get("scaler") is not None:
        job.scaler.load_state_dict(saved["scaler"])
    job.kept.load_state_dict(saved.get("user"))


def broadcast(job: Elastic, source: int, resumed: bool) -> tuple[int, bool]:
    """Rank ``source``'s state to every rank of the group: its size, then one ``torch.save``
    blob. Returns (bytes, whether the state was resumed from a checkpoint)."""
    if job.rank == source:
        buf = io.BytesIO()
        torch.save(state(job, resumed), buf)
        blob = buf.getvalue()
        size = torch.tensor([len(blob)], dtype=torch.int64, device=job.device)
    else:
        size = torch.zeros(1, dtype=torch.int64, device=job.device)
    dist.broadcast(size, src=source)
    n = int(size.item())
    if job.rank == source:
        data = torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(job.device)
    else:
        data = torch.empty(n, dtype=torch.uint8, device=job.device)
    dist.broadcast(data, src=source)
    if job.rank == source:
        return n, resumed
    received = torch.load(io.BytesIO(data.cpu().numpy().tobytes()), map_location="cpu", weights_only=True)
    load(job, received)
    return n, bool(received["resumed"])


def write_checkpoint(job: Elastic) -> None:
    """The state this rank holds, to ``job.checkpoint_path``, whole or not at all."""
    path = os.path.abspath(job.checkpoint_path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        torch.save(state(job, False), f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dirfd = os.open(os.path.dirname(path), os.O_RDONLY)
    try:
        os.fsync(dirfd)
    finally:
        os.close(dirfd)


def read_checkpoint(job: Elastic) -> bool:
    """Loads ``job.checkpoint_path`` when it exists; a file that is not the package's is
    refused, saying how to start from it."""
    path = job.checkpoint_path
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
    load(job, saved)
    p = job.progress
    say(f"resuming from {path}: epoch {p['epoch'] + 1}, step {p['global_step']}")
    return True
