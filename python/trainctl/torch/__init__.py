"""Elastic data-parallel PyTorch under ``trainctl run``: a lost node costs the survivors the
step in flight, a joining node takes the state from a peer, no worker restarts, and every
epoch's sample digest proves each sample was trained once. ``help(Elastic)`` shows a whole
loop; docs/PYTORCH.md in the trainctl repository has what each pattern needs.

``UsageError``: a loop the package cannot make exact, refused before it changes anything.
``DivergedError``: the ranks' states parted; the job stops rather than train a wrong model.
"""

from __future__ import annotations

from ._check import DivergedError
from ._elastic import Elastic, Step
from ._guards import UsageError

__all__ = ["DivergedError", "Elastic", "Step", "UsageError"]
