"""Elastic data-parallel PyTorch under ``trainctl run``: a lost node costs the survivors the
step in flight, a joining node takes the state from a peer, no worker restarts, and every
epoch's sample digest proves each sample was trained once. ``help(Elastic)`` shows a whole
loop; docs/PYTORCH.md in the trainctl repository has what each pattern needs.

``UsageError``: a loop the package cannot make exact, refused before it changes anything.
``DivergedError``: the ranks' states parted; the job stops rather than train a wrong model.
Either one ends the worker with exit code 76, which ``trainctl run`` never retries.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._errors import DivergedError, UsageError, install_excepthook

if TYPE_CHECKING:
    from ._elastic import Elastic
    from ._step import Step

# A UsageError or DivergedError that ends the program ends it with the exit code no launcher
# retries (see _errors).
install_excepthook()

__all__ = ["DivergedError", "Elastic", "Step", "UsageError"]


def __getattr__(name: str) -> Any:
    # The parts that need torch are imported when first named, so that the package's pure
    # parts (the flow, the progress, the protocol's tables) import, and are tested, without it.
    if name == "Elastic":
        from ._elastic import Elastic

        return Elastic
    if name == "Step":
        from ._step import Step

        return Step
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
