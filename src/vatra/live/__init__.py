"""Live recovery (``resilience.live = true``): torchft replica groups, one per process, where a dead
group is dropped from the quorum while the others keep training, and heals from a live peer.

``vatra.live.launcher`` runs the lighthouse and the groups; ``vatra.live.replica`` is one group's
process; ``vatra.live.sync`` is the torchft manager around vatra's step (docs/live-recovery.md).
"""

from __future__ import annotations

__all__: list[str] = []
