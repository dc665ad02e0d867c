"""The safety net: the ranks compare, in collectives the job already runs, what must be equal
on all of them, and a difference stops the job, naming the ranks, the step and what differed.

Every step's agreement carries each rank's *state hash*: a CRC32 of its counters (the steps
applied, the scheduler's place and the learning rates and other hyperparameters of every
parameter group: plain Python numbers, no device synchronisation) and of its weights'
fingerprint as of its last check (a CRC32 of the parameters, taken at every epoch's end and
after every regroup) and each ``state=`` object's (taken at the same points). A group's start
compares the same hash among the ranks that hold the same step before any state travels, and
``job.finish()`` compares the final weights and state. Whatever
pattern made the ranks part (gradients not all-reduced, a scheduler stepped on some ranks,
weights changed on one), it shows within a step of the counters parting or an epoch of the
weights parting, not in the model the user ships.

A hash rides the step's float32 all-reduce as two 16-bit halves in slots of the rank's own
(summing one non-zero value per slot is exact).
"""

from __future__ import annotations

import zlib
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

from ._errors import DivergedError

SLOTS = 2
"""Float32 slots per rank in a step's agreement."""


def crc32(tensors: Iterable[torch.Tensor]) -> int:
    """A CRC32 of the tensors' bytes, in order (whatever their dtype or device)."""
    crc = 0
    for t in tensors:
        crc = zlib.crc32(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes(), crc)
    return crc


def fingerprint(module: torch.nn.Module) -> int:
    """A CRC32 of the module's parameters (buffers differ between DDP's ranks between two
    forwards, as DDP broadcasts them from rank 0 at each)."""
    return crc32(module.parameters())


def _plain(value: Any) -> Any:
    """A hyperparameter as a plain value; a tensor on a device is left out (reading it would
    synchronise the device every step)."""
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, (tuple, list)):
        return tuple(_plain(v) for v in value)
    if isinstance(value, torch.Tensor) and value.device.type == "cpu" and value.numel() == 1:
        return value.item()
    return "?"


def counters(
    step: int,
    weights_fp: int,
    kept_fps: dict[str, int],
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
) -> dict[str, Any]:
    """What every rank must hold alike, by name, in a form to print: the step, the weights'
    fingerprint, each ``state=`` object's, the scheduler's steps and every hyperparameter of
    every parameter group."""
    out: dict[str, Any] = {"step": step, "weights": f"{weights_fp:08x}"}
    for name, fp in kept_fps.items():
        out[name] = f"{fp:08x}"
    if scheduler is not None:
        out["scheduler steps"] = getattr(scheduler, "last_epoch", None)
    groups = optimizer.param_groups
    for i, g in enumerate(groups):
        for k, v in sorted(g.items()):
            if k != "params":
                out[k if len(groups) == 1 else f"{k} (param group {i})"] = _plain(v)
    return out


def state_hash(values: dict[str, Any]) -> int:
    """``values`` as a non-zero 32-bit number (0 marks a rank that has nothing to compare)."""
    return (zlib.crc32(repr(sorted(values.items())).encode()) or 1) & 0xFFFFFFFF


def slots(rank: int, world_size: int, value: int) -> list[float]:
    """``value`` in this rank's slots of a step's agreement, zeros in the others'."""
    out = [0.0] * (SLOTS * world_size)
    out[SLOTS * rank] = float(value & 0xFFFF)
    out[SLOTS * rank + 1] = float(value >> 16)
    return out


def unpack(summed: list[float], world_size: int) -> list[int]:
    """Every rank's value from the summed slots."""
    return [int(round(summed[SLOTS * r])) | (int(round(summed[SLOTS * r + 1])) << 16) for r in range(world_size)]


def _ranks(ranks: list[int]) -> str:
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and runs[-1][1] == r - 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
    return ("rank " if len(ranks) == 1 else "ranks ") + text


HINTS = {
    "weights": "weights that parted: gradients not all-reduced (a backward under no_sync(), or "
    "through the model itself instead of job.model), or weights changed on some ranks only",
    "scheduler steps": "a scheduler stepped a different number of times on some ranks",
    "step": "ranks at different steps",
}
STATE = (
    "a state= object that parted: kept on some ranks only (on rank 0 alone, say), or "
    "changed from something each rank has its own of"
)
HYPERPARAMETERS = (
    "hyperparameters that parted: an LR scheduler not given to Elastic (scheduler=), or a "
    "learning rate changed on some ranks only"
)


def describe(details: list[dict[str, Any]], where: str) -> str:
    """The message for ranks whose ``details`` (``counters``, one per rank, with ``rank``)
    differ."""
    lines = [f"the ranks no longer hold the same training state {where}:"]
    hints = []
    keys = [k for k in details[0] if k != "rank"]
    for key in keys:
        by_value: dict[str, list[int]] = {}
        for d in details:
            by_value.setdefault(repr(d.get(key)), []).append(d["rank"])
        if len(by_value) > 1:
            shown = "; ".join(f"{_ranks(r)}: {v}" for v, r in by_value.items())
            lines.append(f"  {key}: {shown}")
            hints.append(HINTS.get(key, STATE if key.startswith("state") else HYPERPARAMETERS))
    if len(lines) == 1:
        lines.append("  (their state hashes differ; the details did not)")
    lines.append(
        "Likely: " + "; ".join(dict.fromkeys(hints)) + ". The job stops here: training on would give a "
        "wrong model. See the Python package's README for the loop patterns that stay exact."
    )
    return "\n".join(lines)


def compare(hashes: list[int], where: str, rank: int, counters: Callable[[], dict[str, Any]]) -> None:
    """Raises ``DivergedError`` when the non-zero ``hashes`` differ, after every rank of the
    group has gathered every rank's ``counters()`` (read only then; all ranks see the same
    hashes, so all come here); ``rank`` is this one's."""
    seen = {h for h in hashes if h}
    if len(seen) <= 1:
        return
    mine = {"rank": rank, **counters()}
    everyone: list[Any] = [None] * dist.get_world_size()
    try:
        dist.all_gather_object(everyone, mine)
    except Exception:  # noqa: BLE001 - the group broke meanwhile: say what this rank knows
        everyone = [mine]
    details = [d for d in everyone if d is not None and hashes[d["rank"]]]
    raise DivergedError(describe(details, where))
