"""``Split``: an in-memory split (tensors, or a token stream read as windows) fetched a batch at a time."""

from __future__ import annotations

import numpy as np
import torch

from vatra.data._base import BatchedDataset


class Split(BatchedDataset):
    """One in-memory split: labelled samples, or a token stream read as sliding windows.

    Labelled: ``x`` is (N, *input_shape) float32 and ``y`` is (N, ...): int64 classes, or float
    targets (regression, multilabel).
    Language modelling: ``x`` is the whole (T,) int64 token stream, ``y`` is None and sample
    ``i`` is the window starting at ``starts[i]`` (every start ``0 .. T - block_size - 1`` when
    ``starts`` is None, so each window has a next-token target for all its positions).
    """

    def __init__(
        self,
        x: torch.Tensor,
        y: torch.Tensor | None = None,
        *,
        block_size: int | None = None,
        starts: torch.Tensor | None = None,
    ) -> None:
        if (y is None) == (block_size is None):
            raise ValueError("a Split has either labels y (classification) or a block_size (lm)")
        if y is not None and len(y) != len(x):
            raise ValueError(f"x has {len(x)} samples but y has {len(y)} labels")
        if block_size is not None and x.numel() <= block_size:
            raise ValueError(f"token stream of {x.numel()} tokens is too short for block_size {block_size}")
        self.x = x
        self.y = y
        self.block_size = block_size
        self.starts = starts

    @property
    def is_lm(self) -> bool:
        return self.block_size is not None

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.y is not None:
            return self.x[i], self.y[i]
        x, y = self.get_batch(np.array([i]))
        return x[0], y[0]

    def __len__(self) -> int:
        if self.block_size is None:
            return len(self.x)
        if self.starts is not None:
            return len(self.starts)
        return self.x.numel() - self.block_size

    @property
    def labels(self) -> np.ndarray | None:
        """Class labels as numpy, for label-aware sharding; None for lm and non-class targets."""
        if self.y is None or self.y.dim() != 1 or self.y.is_floating_point():
            return None
        return self.y.numpy()

    def get_batch(self, idx: torch.Tensor | np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets of samples ``idx``: (B, *input_shape), (B,); lm: (B, block), (B, block)."""
        idx_t = torch.as_tensor(idx, dtype=torch.int64)
        if self.y is not None:
            return self.x[idx_t], self.y[idx_t]
        assert self.block_size is not None
        start = idx_t if self.starts is None else self.starts[idx_t]  # (B,)
        offsets = torch.arange(self.block_size + 1)  # (block+1,)
        windows = self.x[start[:, None] + offsets[None, :]]  # (B, block+1)
        return windows[:, :-1], windows[:, 1:]
