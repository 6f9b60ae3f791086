"""Evaluation metrics per task kind against sklearn and hand computations, and their exact merge
across ranks."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from sklearn import metrics as skm
from tests.conftest import dataset_spec
from torch import nn
from torch.nn import functional as F

from vatra.config._sections import TrainConfig
from vatra.data._base import DatasetSpec, TargetSpec
from vatra.losses import (
    BCE,
    MSE,
    ClassificationMetrics,
    CrossEntropy,
    Huber,
    ListNet,
    Metrics,
    MultiTask,
    build_loss,
    build_metrics,
    listnet,
)

# Histogram AUC: 2048 bins on [0, 1]; for scores spread over the interval the tie error is ~2.4e-4.
AUC_TOL = 2e-3
# Sums of float64 terms in a different order: equal up to rounding.
MERGE_RTOL = MERGE_ATOL = 1e-12


def run_metrics(metrics: Metrics, batches: list[tuple[Any, Any]]) -> dict[str, float]:
    for output, target in batches:
        metrics.update(output, target)
    return metrics.compute(metrics.state())


def split(x: torch.Tensor, parts: int = 4) -> list[torch.Tensor]:
    return list(torch.chunk(x, parts))


# ---------------------------------------------------------------- metrics vs references


def test_classification_metrics_match_sklearn() -> None:
    # Prepare: 5 classes, class 4 never true nor predicted (left out of macro-F1 as in sklearn)
    torch.manual_seed(2)
    logits = torch.randn(300, 5)
    logits[:, 4] = -100.0
    labels = torch.randint(0, 4, (300,))
    cfg, loss = TrainConfig(), CrossEntropy()

    # Execute
    got = run_metrics(
        build_metrics("classification", cfg, dataset_spec("classification", 5), loss),
        list(zip(split(logits), split(labels), strict=True)),
    )

    # Assert: counts are exact; the loss is a batch-size-weighted mean of float32 means
    pred = logits.argmax(-1).numpy()
    assert got["accuracy"] == pytest.approx(skm.accuracy_score(labels, pred), abs=1e-12)
    assert got["macro_f1"] == pytest.approx(skm.f1_score(labels, pred, average="macro"), abs=1e-12)
    assert got["loss"] == pytest.approx(F.cross_entropy(logits, labels).item(), rel=1e-5)
    assert "auc" not in got


def test_binary_auc_matches_sklearn_within_histogram_error() -> None:
    # Prepare: informative but overlapping scores
    torch.manual_seed(3)
    labels = torch.randint(0, 2, (2000,))
    logits = torch.stack([torch.zeros(2000), 1.5 * labels + torch.randn(2000)], dim=1)
    cfg = TrainConfig()

    # Execute
    got = run_metrics(
        build_metrics("classification", cfg, dataset_spec("classification", 2), CrossEntropy()),
        list(zip(split(logits), split(labels), strict=True)),
    )

    # Assert
    score = torch.softmax(logits, -1)[:, 1].numpy()
    assert got["auc"] == pytest.approx(skm.roc_auc_score(labels, score), abs=AUC_TOL)


def test_multilabel_metrics_match_sklearn() -> None:
    # Prepare: 4 labels; the last is never true and never predicted (F1 0, no AUC)
    torch.manual_seed(4)
    y = (torch.rand(400, 4) < torch.tensor([0.3, 0.5, 0.7, 0.0])).float()
    logits = 2.0 * (y - 0.5) + torch.randn(400, 4)
    logits[:, 3] = -5.0
    metrics = build_metrics("multilabel", TrainConfig(), dataset_spec("multilabel", 4), BCE())

    # Execute
    got = run_metrics(metrics, list(zip(split(logits), split(y), strict=True)))

    # Assert
    pred = (logits > 0).numpy()
    assert got["accuracy"] == pytest.approx((pred == y.numpy()).mean(), abs=1e-12)
    assert got["macro_f1"] == pytest.approx(
        skm.f1_score(y, pred, average="macro", zero_division=0), abs=1e-12
    )
    prob = torch.sigmoid(logits).numpy()
    expected_auc = skm.roc_auc_score(y[:, :3], prob[:, :3], average="macro")
    assert got["auc"] == pytest.approx(expected_auc, abs=AUC_TOL)


def test_single_label_multilabel_auc_accepts_b_and_b1_shapes() -> None:
    # Prepare: output (B, 1) against target (B,)
    torch.manual_seed(5)
    y = torch.randint(0, 2, (500,)).float()
    logits = (y + torch.randn(500))[:, None]

    # Execute: spec does not know the width (0); it comes from the first output
    got = run_metrics(
        build_metrics("multilabel", TrainConfig(), dataset_spec("multilabel", 0), BCE()), [(logits, y)]
    )

    # Assert
    assert got["auc"] == pytest.approx(skm.roc_auc_score(y, torch.sigmoid(logits[:, 0])), abs=AUC_TOL)
    assert got["loss"] == pytest.approx(F.binary_cross_entropy_with_logits(logits[:, 0], y).item(), rel=1e-6)


def test_regression_metrics_match_sklearn() -> None:
    # Prepare: 2 outputs
    torch.manual_seed(6)
    y = torch.randn(200, 2) * torch.tensor([1.0, 5.0])
    pred = y + torch.randn(200, 2)
    metrics = build_metrics("regression", TrainConfig(), dataset_spec("regression", 2), MSE())

    # Execute
    got = run_metrics(metrics, list(zip(split(pred), split(y), strict=True)))

    # Assert: float64 sums; R² from Σy² − (Σy)²/n loses a few digits to cancellation
    yn, pn = y.double().numpy(), pred.double().numpy()
    assert got["mae"] == pytest.approx(skm.mean_absolute_error(yn, pn), rel=1e-9)
    assert got["rmse"] == pytest.approx(math.sqrt(skm.mean_squared_error(yn, pn)), rel=1e-9)
    assert got["r2"] == pytest.approx(skm.r2_score(yn, pn), rel=1e-9)
    assert got["loss"] == pytest.approx(skm.mean_squared_error(yn, pn), rel=1e-5)


def test_ndcg_matches_hand_computation() -> None:
    # Prepare: k = 3.
    # List 1, by score: rel 0, 2, 3 | 1 → DCG = 0 + 3/log2(3) + 7/2 = 5.392789;
    #   ideal 3, 2, 1 → 7 + 3/log2(3) + 1/2 = 9.392789; NDCG = 0.574141.
    # List 2 (last position padded): rel 0, 1 → DCG = 1/log2(3) = 0.630930 = NDCG (ideal 1).
    # List 3: no relevant item (ideal DCG 0): not counted.
    scores = torch.tensor([[0.3, 0.9, 0.1, 0.5], [2.0, 1.0, 9.0, 0.0], [1.0, 2.0, 3.0, 4.0]])
    target = torch.tensor([[3.0, 0.0, 1.0, 2.0], [0.0, 1.0, -1.0, -1.0], [0.0, 0.0, 0.0, -1.0]])
    cfg = TrainConfig(ndcg_k=3)

    # Execute
    got = run_metrics(build_metrics("ranking", cfg, dataset_spec("ranking"), ListNet()), [(scores, target)])

    # Assert
    assert got["ndcg@3"] == pytest.approx((0.574141 + 0.630930) / 2, abs=1e-6)
    assert got["loss"] == pytest.approx(listnet(scores, target).item(), rel=1e-6)


def test_lm_perplexity_is_exp_of_token_mean_loss() -> None:
    # Prepare
    torch.manual_seed(7)
    logits, tokens = torch.randn(6, 5, 11), torch.randint(0, 11, (6, 5))

    # Execute
    got = run_metrics(
        build_metrics("lm", TrainConfig(), dataset_spec("lm", 11), CrossEntropy()),
        list(zip(split(logits, 3), split(tokens, 3), strict=True)),
    )

    # Assert: equal-length sequences, so the per-batch weighting gives the token mean
    token_mean = F.cross_entropy(logits.reshape(-1, 11), tokens.reshape(-1)).item()
    assert got["loss"] == pytest.approx(token_mean, rel=1e-6)
    assert got["perplexity"] == pytest.approx(math.exp(got["loss"]), rel=1e-12)
    assert got["accuracy"] == pytest.approx((logits.argmax(-1) == tokens).double().mean().item(), abs=1e-12)


def test_multitask_metrics_prefix_each_heads_metrics() -> None:
    # Prepare
    torch.manual_seed(8)
    cfg = TrainConfig(
        task="multitask",
        multitask={"heads": {"r": {"task": "regression", "weight": 2.0}, "c": {"task": "classification"}}},
    )
    data = dataset_spec(
        "multitask", heads={"r": TargetSpec("regression", 1), "c": TargetSpec("classification", 3)}
    )
    loss = build_loss(cfg, data)
    output = {"r": torch.randn(40, 1), "c": torch.randn(40, 3)}
    target = {"r": torch.randn(40), "c": torch.randint(0, 3, (40,))}

    # Execute
    got = run_metrics(build_metrics("multitask", cfg, data, loss), [(output, target)])
    alone = run_metrics(ClassificationMetrics(CrossEntropy(), 3), [(output["c"], target["c"])])

    # Assert
    assert isinstance(loss, MultiTask)
    assert got["loss"] == pytest.approx(loss(output, target).item(), rel=1e-6)
    assert got["r_loss"] == pytest.approx(F.mse_loss(output["r"][:, 0], target["r"]).item(), rel=1e-6)
    assert {k: got[f"c_{k}"] for k in alone} == pytest.approx(alone)
    assert {"r_mae", "r_rmse", "r_r2", "c_macro_f1"} <= set(got)


# ---------------------------------------------------------------- mergeability


def _merge_cases() -> dict[str, tuple[str, TrainConfig, DatasetSpec, nn.Module, Any, Any]]:
    torch.manual_seed(9)
    n = 64
    heads_cfg = {"heads": {"r": {"task": "regression"}, "m": {"task": "multilabel"}}}
    mt_cfg = TrainConfig(task="multitask", multitask=heads_cfg)
    mt_spec = dataset_spec(
        "multitask", heads={"r": TargetSpec("regression", 2), "m": TargetSpec("multilabel", 3)}
    )
    return {
        "binary": ("classification", TrainConfig(), dataset_spec("classification", 2), CrossEntropy(),
                   torch.randn(n, 2), torch.randint(0, 2, (n,))),
        "multiclass": ("classification", TrainConfig(), dataset_spec("classification", 4), CrossEntropy(),
                       torch.randn(n, 4), torch.randint(0, 4, (n,))),
        "multilabel": ("multilabel", TrainConfig(), dataset_spec("multilabel", 3), BCE(),
                       torch.randn(n, 3), (torch.rand(n, 3) < 0.4).float()),
        "regression": ("regression", TrainConfig(), dataset_spec("regression", 2), Huber(),
                       torch.randn(n, 2), torch.randn(n, 2)),
        "ranking": ("ranking", TrainConfig(ndcg_k=2), dataset_spec("ranking"), ListNet(),
                    torch.randn(n, 5), torch.randint(-1, 3, (n, 5)).float()),
        "lm": ("lm", TrainConfig(), dataset_spec("lm", 6), CrossEntropy(),
               torch.randn(n, 3, 6), torch.randint(0, 6, (n, 3))),
        "multitask": ("multitask", mt_cfg, mt_spec, build_loss(mt_cfg, mt_spec),
                      {"r": torch.randn(n, 2), "m": torch.randn(n, 3)},
                      {"r": torch.randn(n, 2), "m": (torch.rand(n, 3) < 0.5).float()}),
    }  # fmt: skip


def _take(x: Any, part: slice) -> Any:
    return {k: v[part] for k, v in x.items()} if isinstance(x, dict) else x[part]


@pytest.mark.parametrize("case", list(_merge_cases()))
def test_metrics_merge_exactly_across_ranks(case: str) -> None:
    # Prepare: one "rank" sees everything in 4 batches, two "ranks" see a half each
    task, cfg, data, loss, output, target = _merge_cases()[case]
    quarters = [slice(i * 16, (i + 1) * 16) for i in range(4)]
    whole = build_metrics(task, cfg, data, loss)  # type: ignore[arg-type]
    ranks = [build_metrics(task, cfg, data, loss) for _ in range(2)]  # type: ignore[arg-type]
    size_before = ranks[1].state().numel()

    # Execute
    for q in quarters:
        whole.update(_take(output, q), _take(target, q))
    for i, q in enumerate(quarters):
        ranks[i // 2].update(_take(output, q), _take(target, q))
    merged = ranks[0].state() + ranks[1].state()  # what the trainer's all-reduce SUM gives

    # Assert: same state length whatever was seen; the same metrics up to float64 rounding
    assert whole.state().dtype == torch.float64 and whole.state().dim() == 1
    assert whole.state().numel() == size_before == merged.numel()
    torch.testing.assert_close(merged, whole.state(), rtol=MERGE_RTOL, atol=MERGE_ATOL)
    expected, got = whole.compute(whole.state()), whole.compute(merged)
    assert got.keys() == expected.keys()
    for key in expected:
        assert got[key] == pytest.approx(expected[key], rel=MERGE_RTOL, abs=MERGE_ATOL, nan_ok=True), key


def test_unknown_class_count_is_taken_from_the_first_output() -> None:
    # Prepare: the spec does not know the number of classes
    unknown = build_metrics(
        "classification", TrainConfig(), dataset_spec("classification", 0), CrossEntropy()
    )
    preset = build_metrics("classification", TrainConfig(), dataset_spec("classification", 0), CrossEntropy())
    preset.num_classes = 3  # what the trainer does when it knows the model's width

    # Execute / Assert
    with pytest.raises(RuntimeError, match=r"set metrics.num_classes"):
        unknown.state()
    unknown.update(torch.randn(4, 3), torch.tensor([0, 1, 2, 0]))
    assert unknown.num_classes == 3
    assert unknown.state().numel() == preset.state().numel() == 2 + 9
