"""Loss and accuracy shared by classification and language-model outputs."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import functional as F


def loss_fn(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean cross-entropy; lm logits (B, T, V) are flattened to (B*T, V) against (B*T,) targets."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


@torch.no_grad()
def count_correct(logits: Tensor, targets: Tensor) -> tuple[int, int]:
    """(correct argmax predictions, predictions); for lm every position counts.

    NOTE: ``.item()`` is a device-host sync point; call it per eval batch, not per train step.
    """
    correct = (logits.argmax(dim=-1) == targets).sum().item()
    return int(correct), targets.numel()
