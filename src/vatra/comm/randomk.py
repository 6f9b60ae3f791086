"""``randomk``: ⌈ratio·n⌉ elements drawn uniformly without replacement, sent as they are.

Not rescaled by n/k: the unbiased variant multiplies the dropped mass by n/k and makes error
feedback diverge; unscaled random-k with error feedback delivers every element eventually.
"""

from __future__ import annotations

import torch

from vatra.comm._base import SparseCompressor


class RandomK(SparseCompressor):
    stochastic = True

    def select(self, flat: torch.Tensor, k: int) -> torch.Tensor:
        return torch.randperm(flat.numel(), generator=self.generator, device=flat.device)[:k]
