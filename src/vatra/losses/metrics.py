"""Evaluation metrics per task kind, kept as sums so that ranks merge them exactly (all-reduce SUM)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from vatra.data._base import DatasetSpec, TaskKind
from vatra.losses._base import Metrics, align, flatten_tokens, ratio
from vatra.losses.multitask import MultiTask
from vatra.losses.ranking import ndcg_at_k

if TYPE_CHECKING:
    from vatra.config._sections import TrainConfig

AUC_BINS = 2048
"""Equal-width score bins on [0, 1] of the AUC histograms.

A positive and a negative whose scores share a bin count as a tie (half a correctly ordered pair),
so the histogram AUC differs from the exact one by at most half the share of positive–negative
pairs that share a bin: 1/(2·bins) ≈ 2.4e-4 for scores spread evenly over [0, 1], more when a
confident model's probabilities pile up in the first and last bins."""
MAX_AUC_LABELS = 64  # multilabel AUC keeps 2 × AUC_BINS sums per label; none beyond this many labels


def count_into(sums: Tensor, index: Tensor, weight: Tensor | None = None) -> None:
    """``sums[index[j]] += weight[j]`` (1 by default), in place and without a host sync."""
    index = index.reshape(-1)
    source = torch.ones_like(index, dtype=sums.dtype) if weight is None else weight.reshape(-1).to(sums.dtype)
    sums.index_add_(0, index, source)


def score_bins(probability: Tensor) -> Tensor:
    """The AUC histogram bin of each probability (int64, same shape)."""
    return (probability.double() * AUC_BINS).long().clamp_(0, AUC_BINS - 1)


def histogram_auc(positives: Tensor, negatives: Tensor) -> Tensor:
    """ROC AUC from score histograms (..., bins): P(score+ > score−) + ½ P(same bin); NaN when a
    row has no positive or no negative."""
    below = torch.cumsum(negatives, dim=-1) - negatives  # negatives in lower bins, (..., bins)
    ordered = (positives * (below + 0.5 * negatives)).sum(dim=-1)
    pairs = positives.sum(dim=-1) * negatives.sum(dim=-1)
    return torch.where(pairs > 0, ordered / pairs.clamp(min=1), float("nan"))


def f1_scores(tp: Tensor, fp: Tensor, fn: Tensor) -> Tensor:
    """Per class F1 = 2TP / (2TP + FP + FN); 0 where the class was neither true nor predicted."""
    den = 2 * tp + fp + fn
    return torch.where(den > 0, 2 * tp / den.clamp(min=1), 0.0)


def safe_exp(x: float) -> float:
    return math.exp(x) if x < 709.0 else float("inf")  # math.exp overflows past ~709.78


def columns(x: Tensor) -> Tensor:
    """(B,) → (B, 1); (B, K, ...) → (B, K·...)."""
    return x.reshape(x.shape[0], -1)


class ClassificationMetrics(Metrics):
    """``loss``, ``accuracy``, ``macro_f1`` (sklearn's macro average over the classes present in
    targets or predictions) from a C×C confusion matrix, and ``auc`` with 2 classes (score =
    softmax[:, 1]). lm-shaped outputs count every token; targets < 0 (ignore_index) are not counted."""

    sized_by_classes = True

    def task_size(self) -> int:
        c = self.num_classes
        return c * c + (2 * AUC_BINS if c == 2 else 0)

    def add(self, sums: Tensor, output: Tensor, target: Tensor) -> None:
        c = self.num_classes
        logits, labels = flatten_tokens(output, target, "classification metrics")  # (N, C), (N,)
        counted = labels >= 0
        labels = labels.clamp(min=0)
        count_into(sums[: c * c], labels * c + logits.argmax(dim=-1), counted)  # row = true, col = predicted
        if c == 2:
            score = torch.softmax(logits.float(), dim=-1)[:, 1]
            count_into(sums[c * c :], (labels != 1) * AUC_BINS + score_bins(score), counted)

    def summarise(self, sums: Tensor, n: float) -> dict[str, float]:
        c = self.num_classes
        confusion = sums[: c * c].view(c, c)
        true, predicted, tp = confusion.sum(dim=1), confusion.sum(dim=0), confusion.diagonal()
        present = (true + predicted) > 0
        f1 = f1_scores(tp, predicted - tp, true - tp)
        out = {
            "accuracy": ratio(float(tp.sum()), float(confusion.sum())),
            "macro_f1": float(f1[present].mean()) if present.any() else float("nan"),
        }
        if c == 2:
            hist = sums[c * c :].view(2, AUC_BINS)  # [positives, negatives]
            out["auc"] = float(histogram_auc(hist[0], hist[1]))
        return out


class LanguageModelMetrics(Metrics):
    """``loss`` (token mean for equal-length sequences), ``perplexity`` = exp(loss), token ``accuracy``."""

    def task_size(self) -> int:
        return 2  # correct tokens, tokens

    def add(self, sums: Tensor, output: Tensor, target: Tensor) -> None:
        logits, labels = flatten_tokens(output, target, "lm metrics")  # (B*T, V), (B*T,)
        counted = labels >= 0
        sums[0] += (counted & (logits.argmax(dim=-1) == labels)).sum()
        sums[1] += counted.sum()

    def compute(self, state: Tensor) -> dict[str, float]:
        out = super().compute(state)
        return {**out, "perplexity": safe_exp(out["loss"])}

    def summarise(self, sums: Tensor, n: float) -> dict[str, float]:
        return {"accuracy": ratio(float(sums[0]), float(sums[1]))}


class MultilabelMetrics(Metrics):
    """``loss``, element-wise ``accuracy`` (positive when logit > 0, i.e. probability above 0.5),
    ``macro_f1`` over all labels (0 for a label never true nor predicted, as sklearn), and ``auc``:
    the label's, or the mean over labels that have both classes (up to ``MAX_AUC_LABELS`` labels)."""

    sized_by_classes = True

    def width(self, output: Tensor) -> int:
        return math.prod(output.shape[1:])

    def has_auc(self) -> bool:
        return self.num_classes <= MAX_AUC_LABELS

    def task_size(self) -> int:
        labels = self.num_classes
        return 3 * labels + (2 * AUC_BINS * labels if self.has_auc() else 0)

    def add(self, sums: Tensor, output: Tensor, target: Tensor) -> None:
        labels = self.num_classes
        logits, y = align(output, target, "multilabel metrics")
        logits, truth = columns(logits), columns(y) > 0.5  # (B, L)
        predicted = logits > 0
        sums[:labels] += (predicted & truth).sum(dim=0)
        sums[labels : 2 * labels] += (predicted & ~truth).sum(dim=0)
        sums[2 * labels : 3 * labels] += (~predicted & truth).sum(dim=0)
        if self.has_auc():
            label = torch.arange(labels, device=logits.device)  # (L,)
            index = label * (2 * AUC_BINS) + (~truth) * AUC_BINS + score_bins(torch.sigmoid(logits.float()))
            count_into(sums[3 * labels :], index)

    def summarise(self, sums: Tensor, n: float) -> dict[str, float]:
        labels = self.num_classes
        tp, fp, fn = sums[: 3 * labels].view(3, labels)
        out = {
            "accuracy": ratio(n * labels - float(fp.sum() + fn.sum()), n * labels),
            "macro_f1": float(f1_scores(tp, fp, fn).mean()) if n else float("nan"),
        }
        if self.has_auc():
            hist = sums[3 * labels :].view(labels, 2, AUC_BINS)
            auc = histogram_auc(hist[:, 0], hist[:, 1])  # (L,)
            defined = ~auc.isnan()
            out["auc"] = float(auc[defined].mean()) if defined.any() else float("nan")
        return out


class RegressionMetrics(Metrics):
    """``loss``, ``mae`` and ``rmse`` over all elements, ``r2`` averaged uniformly over outputs (as
    sklearn's ``r2_score``: an output with constant targets scores 1 if predicted exactly, else 0)."""

    sized_by_classes = True

    def width(self, output: Tensor) -> int:
        return math.prod(output.shape[1:])

    def task_size(self) -> int:
        return 4 * self.num_classes  # per output: Σy, Σy², Σ(y − ŷ)², Σ|y − ŷ|

    def add(self, sums: Tensor, output: Tensor, target: Tensor) -> None:
        pred, y = align(output, target, "regression metrics")
        pred, y = columns(pred).double(), columns(y).double()  # (B, K)
        error = y - pred
        terms = torch.stack([y, y.square(), error.square(), error.abs()])  # (4, B, K)
        sums += terms.sum(dim=1).reshape(-1)

    def summarise(self, sums: Tensor, n: float) -> dict[str, float]:
        sum_y, sum_y2, sse, sae = sums.view(4, self.num_classes)
        elements = n * self.num_classes
        if not n:
            return {"mae": float("nan"), "rmse": float("nan"), "r2": float("nan")}
        ss_tot = sum_y2 - sum_y.square() / n
        r2 = torch.where(ss_tot > 0, 1 - sse / ss_tot.clamp(min=torch.finfo(torch.float64).tiny), 0.0)
        r2 = torch.where((ss_tot <= 0) & (sse == 0), 1.0, r2)
        return {
            "mae": float(sae.sum()) / elements,
            "rmse": math.sqrt(float(sse.sum()) / elements),
            "r2": float(r2.mean()),
        }


class RankingMetrics(Metrics):
    """``loss`` (mean over lists) and ``ndcg@k``: the mean NDCG@k over lists with a relevant item
    (lists whose ideal DCG is 0 are left out); see :func:`~vatra.losses.ranking.ndcg_at_k`."""

    def __init__(self, loss: nn.Module, k: int) -> None:
        super().__init__(loss)
        self.k = k

    def task_size(self) -> int:
        return 2  # Σ NDCG over counted lists, counted lists

    def add(self, sums: Tensor, output: Tensor, target: Tensor) -> None:
        ndcg, counted = ndcg_at_k(output, target, self.k)
        sums[0] += ndcg.sum()
        sums[1] += counted.sum()

    def summarise(self, sums: Tensor, n: float) -> dict[str, float]:
        return {f"ndcg@{self.k}": ratio(float(sums[0]), float(sums[1]))}


class MultitaskMetrics(Metrics):
    """``loss`` (the whole multitask loss: weights and penalties), then ``{head}_{metric}`` from each
    head's metrics (``{head}_loss`` is the head's own loss). Set ``heads[name].num_classes`` where the
    spec does not know a head's size. The state is [loss sum, samples, head 1's state, ...]."""

    def __init__(self, loss: nn.Module, multitask: MultiTask, heads: Mapping[str, Metrics]) -> None:
        super().__init__(loss)
        self.multitask = multitask  # splits the loss into heads (``loss`` itself when it is a MultiTask)
        self.heads = dict(heads)

    def size(self) -> int:
        return 2 + sum(head.size() for head in self.heads.values())

    def to(self, device: torch.device | str) -> MultitaskMetrics:
        super().to(device)
        if self.multitask is not self.loss:  # head losses built here from the config
            self.multitask.to(device)
        for head in self.heads.values():
            head.to(device)
        return self

    def update(self, output: Any, target: Any) -> None:
        with torch.no_grad():
            parts = self.multitask.head_losses(output, target)
            if self.loss is self.multitask:
                total = self.multitask.combine(parts, output, target)
            else:
                total = self.loss(output, target)
            first = target[next(iter(self.heads))]
            if self._sums is None:
                self.device = first.device
                self._sums = torch.zeros(2, dtype=torch.float64, device=self.device)
            self._sums[0] += total.detach().double() * first.shape[0]
            self._sums[1] += first.shape[0]
            for name, head in self.heads.items():
                head.accumulate(output[name], target[name], parts[name])

    def state(self) -> Tensor:
        own = (
            self._sums if self._sums is not None else torch.zeros(2, dtype=torch.float64, device=self.device)
        )
        return torch.cat([own, *(head.state().to(own.device) for head in self.heads.values())])

    def compute(self, state: Tensor) -> dict[str, float]:
        s = state.detach().to("cpu", torch.float64)
        out = {"loss": ratio(float(s[0]), float(s[1]))}
        start = 2
        for name, head in self.heads.items():
            size = head.size()
            out.update(
                {f"{name}_{key}": value for key, value in head.compute(s[start : start + size]).items()}
            )
            start += size
        return out


_HEAD_METRICS: dict[str, type[Metrics]] = {
    "classification": ClassificationMetrics,
    "multilabel": MultilabelMetrics,
    "regression": RegressionMetrics,
}


def build_metrics(task: TaskKind, cfg: TrainConfig, spec: DatasetSpec, loss: nn.Module) -> Metrics:
    """The evaluation metrics of ``task`` (resolved: not "auto"), with the run's ``loss``."""
    if task == "lm":
        return LanguageModelMetrics(loss)
    if task == "ranking":
        return RankingMetrics(loss, cfg.ndcg_k)
    if task == "multitask":
        multitask = loss if isinstance(loss, MultiTask) else MultiTask.from_config(cfg.multitask, spec)
        heads: dict[str, Metrics] = {}
        for name, kind in multitask.kinds.items():
            head_cfg = cfg.multitask.heads.get(name)
            size = spec.heads[name].size if name in spec.heads else (head_cfg.size if head_cfg else 0)
            heads[name] = _HEAD_METRICS[kind](multitask.losses[name], size)
        return MultitaskMetrics(loss, multitask, heads)
    if task in _HEAD_METRICS:
        return _HEAD_METRICS[task](loss, spec.num_classes)
    raise ValueError(f"no metrics for task {task!r}")
