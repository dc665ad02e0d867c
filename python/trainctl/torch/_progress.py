"""Where a run stands: its epoch, its place in the epoch, its steps and samples, the epoch's
sample digest so far. It travels with the state and is in the checkpoint (as a dict, so that
a checkpoint of an older package, which lacks the later fields, loads with their defaults)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass
class Progress:
    epoch: int = 0
    """0-based."""
    position: int = 0
    """Samples of the epoch's order trained by every rank together so far."""
    global_step: int = 0
    """Updates applied (never reset by an epoch or a regroup)."""
    samples_seen: int = 0
    epoch_digest: int = 0
    """The epoch's sample digest so far (``trainctl.sampler.digest``, summed)."""
    world_size: int = 0
    """The world size this state was trained at (0: none yet); ``on_resize`` hears a change."""
    epoch_end_evals: int = -1
    """Calls of ``job.evaluate()`` since the epoch's batches ended (-1: they have not): a rank
    that comes in then skips as many (see ``Flow``)."""

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, saved: dict[str, Any]) -> Progress:
        return cls(**{f.name: int(saved.get(f.name, f.default)) for f in dataclasses.fields(cls)})

    def next_epoch(self) -> None:
        """The epoch's end: the next one, from its start."""
        self.epoch += 1
        self.position = 0
        self.epoch_digest = 0
        self.epoch_end_evals = -1
