"""A step's agreement: what every rank must know of every other before it applies the step.

Each rank's part: its flags (``regroup.raised``: stop, pause, leave, rank 0 leaving), the
samples it trained and their digest, its state hash (``_check``) and its times (the straggler
watch's). They ride the last bucket of DDP's gradient all-reduce (``comm_hook``), or, when
that cannot carry them (no backward, gradients that are not float32), an all-reduce of their
own (``agree``): the agreement costs no collective of its own. Every value is summed, so each
rank's goes in slots of its own, and the digest in eight 8-bit limbs (exact in float32 for up
to 65,536 ranks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from .. import regroup, stragglers
from ..sampler import MASK, digest
from . import _check, _guards

# The flags before the ranks' slots: stop, pause, leaving, rank 0 leaving, samples, and the
# samples' digest in eight 8-bit limbs.
FLAGS = 13


@dataclass(frozen=True)
class Outcome:
    """A step's agreement, summed over every rank."""

    agreed: regroup.Agreed
    samples: int
    digest: int
    hashes: list[int]
    """Every rank's state hash (``_check``)."""
    times: list[Any]
    """Every rank's times (``stragglers.unpack``), or none when they did not ride."""


def flags(raised: regroup.Raised, trained: list[int]) -> list[float]:
    """One rank's flags for the step that trained samples ``trained``."""
    d = digest(trained)
    values = [float(raised.stop), float(raised.pause), float(raised.leave), float(raised.rank0_leaves)]
    return values + [float(len(trained))] + [float((d >> (8 * k)) & 0xFF) for k in range(8)]


class Agreement:
    """The agreement of the step under way (see the module's doc)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._out: torch.Tensor | None = None
        self._in: torch.Tensor | None = None
        self._hook_ran = False
        # This rank's times, asked for when its part leaves (its compute is over then).
        self._times: Callable[[torch.device], torch.Tensor] | None = None

    def prepare(
        self, parts: list[float], times: Callable[[torch.device], torch.Tensor]
    ) -> None:
        """This rank's part of the step's agreement (flags and state-hash slots), and how to
        take its times when it leaves."""
        self._out = torch.tensor(parts, dtype=torch.float32, device=self.device)
        self._in = None
        self._hook_ran = False
        self._times = times

    def comm_hook(self, _state, bucket):  # type: ignore[no-untyped-def]
        """DDP's gradient all-reduce (averaged, as DDP's own), whose last bucket also carries
        the step's agreement. (No annotations: DDP checks the hook's, and takes only its own
        classes there.)"""
        self._hook_ran = True
        t = bucket.buffer()
        n, world = t.numel(), dist.get_world_size()
        out = self._out
        if bucket.is_last() and out is not None and t.dtype == torch.float32 and self._times is not None:
            self._out = None
            joined = torch.cat([t, out, self._times(t.device)])
            fut = dist.all_reduce(joined, async_op=True).get_future()

            def split(fut: Any) -> torch.Tensor:
                summed = fut.value()[0]
                self._in = summed[n:].clone()
                return summed[:n].div_(world)

            return fut.then(split)
        fut = dist.all_reduce(t, async_op=True).get_future()
        return fut.then(lambda fut: fut.value()[0].div_(world))

    def agree(self, world_size: int, module: torch.nn.Module, ddp_options: dict[str, Any]) -> Outcome:
        """The step's agreement over all ranks: from the gradient all-reduce when it carried
        it, else by an all-reduce of its own (after refusing a step whose gradients were not
        all-reduced, naming why)."""
        summed, out, times = self._in, self._out, self._times
        self._in = self._out = None
        if summed is None:
            _guards.refuse_unreduced(module, self._hook_ran, ddp_options)
            assert out is not None and times is not None
            summed = torch.cat([out, times(self.device)])
            dist.all_reduce(summed)
        values = summed.tolist()
        v = [int(round(x)) for x in values[:FLAGS]]
        checks = FLAGS + _check.SLOTS * world_size
        rest = values[checks:]
        return Outcome(
            agreed=regroup.Agreed(stop=v[0], pause=v[1], leave=v[2], rank0_leaves=v[3]),
            samples=v[4],
            digest=sum(v[5 + k] << (8 * k) for k in range(8)) & MASK,
            hashes=_check.unpack(values[FLAGS:checks], world_size),
            times=stragglers.unpack(rest, world_size) if len(rest) == stragglers.SLOTS * world_size else [],
        )
