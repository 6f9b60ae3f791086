"""``topk``: the ⌈ratio·n⌉ largest-magnitude elements as (int32 index, value) pairs."""

from __future__ import annotations

import torch

from vatra.comm._base import SparseCompressor


class TopK(SparseCompressor):
    auto_ratio = 0.01  # after the loss-settled warm-up and DGC's ramp (25 % → 1 %)
    dense_share = 0.25  # the warm-up's limit, if the loss has not settled before

    def select(self, flat: torch.Tensor, k: int) -> torch.Tensor:
        return flat.abs().topk(k, sorted=False).indices

    def select_rows(self, rows: torch.Tensor, k: int) -> torch.Tensor:
        return rows.abs().topk(k, dim=1, sorted=False).indices
