"""What the loop keeps beside the model, the optimizer, the scheduler and the scaler: the
objects given as ``state=`` (an EMA, the best accuracy so far, a history), each with
``state_dict``/``load_state_dict``.

They travel to a joining rank and into the checkpoint with the rest; the safety net compares
their fingerprints among the ranks at the points where it compares the weights; and what the
loop's code changes in them after a step that applied no update (a dropped step, whose block's
exception the job swallowed) is undone at the next boundary, so that they follow the updates
the job applied, as the scheduler does. A torch ``AveragedModel`` (anything with
``update_parameters``) is gated like the scheduler: its ``update_parameters`` after a block
that applied no update (a micro-batch of an accumulation included) does nothing.

Knows nothing of ``Elastic``: the job gives the objects and asks.
"""

from __future__ import annotations

import copy
import zlib
from typing import Any, Callable

import torch

from ._errors import UsageError


def _named(given: Any) -> list[tuple[str, Any]]:
    """``state=`` as (name, object) pairs: one object, a list or tuple, or a dict of them."""
    if given is None:
        return []
    if isinstance(given, dict):
        return [(f"state[{k!r}]", v) for k, v in given.items()]
    if isinstance(given, (list, tuple)):
        return [(f"state[{i}]", v) for i, v in enumerate(given)]
    return [("state", given)]


class Kept:
    """The objects given as ``state=`` (see the module's doc)."""

    def __init__(self, given: Any):
        self.given = given
        self.objects = _named(given)
        for name, obj in self.objects:
            if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
                raise UsageError(
                    f"Elastic's {name} is a {type(obj).__name__}, which has no state_dict() and "
                    "load_state_dict(): give objects that have them (an nn.Module, torch's "
                    "AveragedModel, a class of your own), one or a list or dict of them"
                )
        self._snapshot: list[Any] | None = None

    def __bool__(self) -> bool:
        return bool(self.objects)

    def parts(self) -> list[Any]:
        """The objects, and the state ``hold`` remembered (copies the job keeps)."""
        return [obj for _, obj in self.objects] + list(self._snapshot or [])

    # --- what travels --------------------------------------------------------------------------

    def state_dict(self) -> Any:
        """Their state, in the shape they were given in (the checkpoint's ``user``)."""
        if self.given is None:
            return None
        states = [obj.state_dict() for _, obj in self.objects]
        if isinstance(self.given, dict):
            return dict(zip(self.given.keys(), states))
        if isinstance(self.given, (list, tuple)):
            return states
        return states[0]

    def load_state_dict(self, saved: Any) -> None:
        if saved is None or self.given is None:
            return
        if isinstance(self.given, dict):
            if not isinstance(saved, dict) or set(saved) != set(self.given):
                raise UsageError(self._mismatch(saved))
            for key, obj in self.given.items():
                obj.load_state_dict(saved[key])
        elif isinstance(self.given, (list, tuple)):
            if not isinstance(saved, list) or len(saved) != len(self.given):
                raise UsageError(self._mismatch(saved))
            for obj, state in zip(self.given, saved):
                obj.load_state_dict(state)
        else:
            self.given.load_state_dict(saved)

    def _mismatch(self, saved: Any) -> str:
        held = f"a dict of {sorted(saved)}" if isinstance(saved, dict) else f"a {type(saved).__name__}"
        return (
            f"the saved state= is {held}, and this program gives {len(self.objects)} objects as "
            f"state= ({', '.join(n for n, _ in self.objects)}): give state= as the run that "
            "saved it did"
        )

    # --- what the safety net compares ----------------------------------------------------------

    def fingerprints(self) -> dict[str, int]:
        """A CRC32 of each object's state that every rank must hold alike, by name: a module's
        parameters and whole-number buffers (counts), not its floating-point buffers, which
        differ among DDP's ranks between two forwards as the model's own do (an AveragedModel
        copies the model's batch-norm statistics); any other object's whole state."""
        return {name: _compared(obj) for name, obj in self.objects}

    # --- undoing what followed a step that applied no update -------------------------------------

    def hold(self) -> None:
        """Remembers their state now: the rank's step applied no update, and what the loop's
        code changes before the next boundary is undone there (``undo``)."""
        if self.objects:
            self._snapshot = [copy.deepcopy(obj.state_dict()) for _, obj in self.objects]

    def undo(self) -> list[str]:
        """Puts back the state ``hold`` remembered, where it changed; returns their names."""
        snapshot, self._snapshot = self._snapshot, None
        if snapshot is None:
            return []
        undone = []
        for (name, obj), state in zip(self.objects, snapshot):
            if fingerprint(obj.state_dict()) != fingerprint(state):
                obj.load_state_dict(state)
                undone.append(name)
        return undone

    # --- gating ----------------------------------------------------------------------------------

    def gate(self, may_run: Callable[[str], bool]) -> None:
        """Each object with ``update_parameters`` (torch's AveragedModel) updates only when
        ``may_run(name)`` says so (see the module's doc)."""
        from ._guards import gate_method

        for name, obj in self.objects:
            if callable(getattr(obj, "update_parameters", None)):
                gate_method(obj, "update_parameters", _asking(may_run, f"{name}.update_parameters()"))


def _asking(may_run: Callable[[str], bool], what: str) -> Callable[[], bool]:
    return lambda: may_run(what)


def _compared(obj: Any) -> int:
    if not isinstance(obj, torch.nn.Module):
        return fingerprint(obj.state_dict())
    params = list(obj.named_parameters())
    counts = [(n, b) for n, b in obj.named_buffers() if not (b.is_floating_point() or b.is_complex())]
    return fingerprint(dict(params + counts))


def fingerprint(value: Any, crc: int = 0) -> int:
    """A CRC32 of a state dict's tensors (their bytes) and plain values (their repr), keys
    included, in order."""
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        crc = zlib.crc32(repr((t.dtype, tuple(t.shape))).encode(), crc)
        return zlib.crc32(t.view(-1).view(torch.uint8).numpy().tobytes(), crc)
    if isinstance(value, dict):
        for k, v in value.items():
            crc = fingerprint(v, zlib.crc32(repr(k).encode(), crc))
        return crc
    if isinstance(value, (list, tuple)):
        for v in value:
            crc = fingerprint(v, crc)
        return crc
    return zlib.crc32(repr(value).encode(), crc)
