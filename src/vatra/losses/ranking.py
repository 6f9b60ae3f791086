"""Listwise ranking: the ListNet loss and NDCG@k over lists whose padded positions have target −1."""

from __future__ import annotations

import torch
from torch import Tensor

from vatra.losses._base import Loss


def as_lists(scores: Tensor, target: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Scores (B, L) or (B, L, 1) and relevance (B, L) as ``(scores, target, mask)``, all (B, L);
    ``mask`` marks real items (target ≥ 0; padding is −1)."""
    if scores.dim() == 3 and scores.shape[-1] == 1:
        scores = scores[..., 0]
    if scores.dim() != 2 or scores.shape != target.shape:
        raise ValueError(
            f"ranking: output shape {tuple(scores.shape)} does not match target shape {tuple(target.shape)}; "
            "expected scores (B, L) or (B, L, 1) against relevance (B, L), one row per list"
        )
    return scores, target, target >= 0


def listnet(scores: Tensor, target: Tensor) -> Tensor:
    """ListNet top-one cross-entropy, mean over lists: −Σ softmax(target) · log softmax(scores).

    Padded positions (target < 0) are left out of both softmaxes; a list with no real item adds
    nothing and is not counted in the mean (a batch of only such lists gives 0).
    """
    scores, target, mask = as_lists(scores, target)
    real_list = mask.any(dim=1, keepdim=True)  # (B, 1)
    # An all-padding row keeps its values (finite) so that no softmax sees only −inf (NaN, also in
    # the gradient); its terms are zeroed below like every padded position.
    hide = ~mask & real_list
    log_p_pred = torch.log_softmax(scores.masked_fill(hide, float("-inf")), dim=1)  # (B, L)
    p_true = torch.softmax(target.to(scores.dtype).masked_fill(hide, float("-inf")), dim=1)
    per_list = -(p_true * log_p_pred.masked_fill(~mask, 0.0)).sum(dim=1)  # (B,)
    return per_list.sum() / real_list.sum().clamp(min=1)


class ListNet(Loss):
    """The ListNet loss (:func:`listnet`) as a module: ``loss(scores, relevance)``."""

    def forward(self, output: Tensor, target: Tensor) -> Tensor:
        return listnet(output, target)


def ndcg_at_k(scores: Tensor, target: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Per list NDCG@k and whether it counts: ``(ndcg (B,), counted (B,) bool)``, float64.

    DCG@k = Σ_{i<k} (2^rel_i − 1) / log2(i + 2) with items ordered by descending score (ties keep
    list order; padding excluded), divided by the ideal DCG@k. A list whose ideal DCG is 0 (no
    relevant item) does not count, and its NDCG is 0 here.
    """
    scores, target, mask = as_lists(scores, target)
    gains = torch.where(mask, torch.exp2(target.double().clamp(min=0)) - 1, 0.0)  # (B, L)
    order = torch.argsort(scores.masked_fill(~mask, float("-inf")), dim=1, descending=True, stable=True)
    top = min(k, gains.shape[1])
    discount = 1.0 / torch.log2(torch.arange(top, device=gains.device, dtype=torch.float64) + 2)  # (top,)
    dcg = (gains.gather(1, order)[:, :top] * discount).sum(dim=1)
    ideal = (gains.sort(dim=1, descending=True).values[:, :top] * discount).sum(dim=1)
    counted = ideal > 0
    return torch.where(counted, dcg / ideal.clamp(min=torch.finfo(torch.float64).tiny), 0.0), counted
