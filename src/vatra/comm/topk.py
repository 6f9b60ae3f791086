"""``topk``: the ⌈ratio·n⌉ largest-magnitude elements as (int32 index, value) pairs."""

from __future__ import annotations

import torch

from vatra.comm._base import SparseCompressor


class TopK(SparseCompressor):
    auto_ratio = 0.01
    dense_share = 0.25

    def select(self, flat: torch.Tensor, k: int) -> torch.Tensor:
        return flat.abs().topk(k, sorted=False).indices
