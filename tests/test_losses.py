"""Losses and evaluation metrics per task kind, against hand computations, torch and sklearn."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from sklearn import metrics as skm
from torch import nn
from torch.nn import functional as F

from vatra.config._sections import TrainConfig
from vatra.data._base import DatasetSpec, TargetSpec
from vatra.errors import ConfigError
from vatra.losses import (
    BCE,
    MSE,
    ClassificationMetrics,
    CrossEntropy,
    FunctionLoss,
    Huber,
    ListNet,
    Metrics,
    MultiTask,
    build_loss,
    build_metrics,
    default_loss,
    listnet,
    resolve_task,
)

# Histogram AUC: 2048 bins on [0, 1]; for scores spread over the interval the tie error is ~2.4e-4.
AUC_TOL = 2e-3
# Sums of float64 terms in a different order: equal up to rounding.
MERGE_RTOL = MERGE_ATOL = 1e-12


def spec(kind: str, num_classes: int = 0, **kw: Any) -> DatasetSpec:
    return DatasetSpec(kind=kind, input_shape=(4,), num_classes=num_classes, **kw)  # type: ignore[arg-type]


def run_metrics(metrics: Metrics, batches: list[tuple[Any, Any]]) -> dict[str, float]:
    for output, target in batches:
        metrics.update(output, target)
    return metrics.compute(metrics.state())


def split(x: torch.Tensor, parts: int = 4) -> list[torch.Tensor]:
    return list(torch.chunk(x, parts))


# ---------------------------------------------------------------- ListNet


def test_listnet_matches_hand_computation_and_ignores_padding() -> None:
    # Prepare: one list of 3 items. softmax(target [2, 0, 1]) = [0.665241, 0.090031, 0.244728];
    # log softmax(scores [1, 2, 0]) = [-1.407606, -0.407606, -2.407606].
    scores = torch.tensor([[1.0, 2.0, 0.0]])
    target = torch.tensor([[2.0, 0.0, 1.0]])
    expected = -(0.665241 * -1.407606 + 0.090031 * -0.407606 + 0.244728 * -2.407606)  # 1.562304

    # Execute: the plain list, the list padded with a −1 target, and a batch with an all-padding list
    plain = listnet(scores, target)
    padded = listnet(torch.tensor([[1.0, 2.0, 0.0, 7.0]]), torch.tensor([[2.0, 0.0, 1.0, -1.0]]))
    batch_scores = torch.tensor([[1.0, 2.0, 0.0, 7.0], [3.0, 1.0, 4.0, 1.0]], requires_grad=True)
    batch_target = torch.tensor([[2.0, 0.0, 1.0, -1.0], [-1.0, -1.0, -1.0, -1.0]])
    with_empty = ListNet()(batch_scores.unsqueeze(-1), batch_target)  # (B, L, 1) scores are squeezed
    with_empty.backward()

    # Assert: 6-digit hand values; padding changes nothing; no NaN in loss or gradient
    assert plain.item() == pytest.approx(expected, abs=1e-5)
    torch.testing.assert_close(padded, plain)
    torch.testing.assert_close(with_empty, plain)
    assert batch_scores.grad is not None and torch.isfinite(batch_scores.grad).all()
    assert batch_scores.grad[0, 3] == 0 and (batch_scores.grad[1] == 0).all()


# ---------------------------------------------------------------- multitask


def test_uncertainty_weighting_favours_the_less_noisy_head() -> None:
    # Prepare: two linear regression targets of the same inputs, noise σ = 0.1 and σ = 1.0
    torch.manual_seed(0)
    n, d = 1024, 8
    x = torch.randn(n, d)
    w = torch.randn(d, 2)
    sigma = {"quiet": 0.1, "noisy": 1.0}
    y = x @ w + torch.randn(n, 2) * torch.tensor([sigma["quiet"], sigma["noisy"]])
    target = {"quiet": y[:, 0], "noisy": y[:, 1]}
    model = nn.Linear(d, 2)
    loss_fn = MultiTask(
        {"quiet": (MSE(), "regression", 1.0), "noisy": (MSE(), "regression", 1.0)}, weighting="uncertainty"
    )
    opt = torch.optim.Adam([*model.parameters(), *loss_fn.parameters()], lr=0.05)

    # Execute: full-batch Adam
    for _ in range(400):
        out = model(x)
        loss = loss_fn({"quiet": out[:, 0], "noisy": out[:, 1:]}, target)  # (B,) and (B, 1) heads
        opt.zero_grad()
        loss.backward()
        opt.step()
    weights = loss_fn.weights()

    # Assert: the optimum is 0.5·exp(−s) = 1/(2σ²) = 50 and 0.5 (±35%: in-sample noise and fit)
    assert weights["quiet"] > 10 * weights["noisy"]
    for head, s in sigma.items():
        assert weights[head] == pytest.approx(1 / (2 * s**2), rel=0.35), weights


def test_multitask_fixed_weights_penalties_and_missing_heads() -> None:
    # Prepare
    output = {"r": torch.tensor([1.0, 2.0]), "c": torch.tensor([[2.0, 0.0], [0.0, 1.0]])}
    target = {"r": torch.tensor([0.0, 2.0]), "c": torch.tensor([0, 0]), "extra": torch.tensor([3.0])}
    loss_fn = MultiTask(
        {"r": (MSE(), "regression", 2.0), "c": (CrossEntropy(), "classification", 0.5)},
        penalties=[(lambda o, t: t["extra"].sum(), 0.1)],
    )

    # Execute
    total = loss_fn(output, target)

    # Assert: Σ w_i·L_i + 0.1·3
    expected = 2.0 * 0.5 + 0.5 * F.cross_entropy(output["c"], target["c"]) + 0.3
    torch.testing.assert_close(total, expected)
    assert loss_fn.weights() == {"r": 2.0, "c": 0.5}
    with pytest.raises(ValueError, match=r"head 'c' is missing from the output; it has: \['r'\]"):
        loss_fn({"r": output["r"]}, target)


# ---------------------------------------------------------------- CrossEntropy, shapes


def test_cross_entropy_matches_torch_with_smoothing_and_class_weights() -> None:
    # Prepare
    torch.manual_seed(1)
    logits, labels = torch.randn(16, 4), torch.randint(0, 4, (16,))
    weight = torch.tensor([1.0, 2.0, 0.5, 3.0])
    lm_logits, lm_labels = torch.randn(2, 5, 7), torch.randint(0, 7, (2, 5))

    # Execute
    ours = CrossEntropy(label_smoothing=0.1, weight=weight)(logits, labels)
    lm = CrossEntropy(label_smoothing=0.2)(lm_logits, lm_labels)

    # Assert: identical computation, float32 tolerance
    torch.testing.assert_close(ours, F.cross_entropy(logits, labels, weight=weight, label_smoothing=0.1))
    ref = F.cross_entropy(lm_logits.reshape(-1, 7), lm_labels.reshape(-1), label_smoothing=0.2)
    torch.testing.assert_close(lm, ref)


def test_losses_squeeze_single_columns_and_name_mismatched_shapes() -> None:
    # Prepare
    pred, y = torch.tensor([[0.5], [1.5]]), torch.tensor([1.0, 1.0])

    # Execute / Assert: (B, 1) against (B,) on either side
    torch.testing.assert_close(MSE()(pred, y), torch.tensor(0.25))
    torch.testing.assert_close(MSE()(pred[:, 0], y[:, None]), torch.tensor(0.25))
    torch.testing.assert_close(Huber(delta=0.1)(pred, y), torch.tensor(0.045))
    torch.testing.assert_close(BCE()(pred, y), F.binary_cross_entropy_with_logits(pred[:, 0], y))
    with pytest.raises(ValueError, match=r"output shape \(2, 3\) does not match target shape \(2, 2\)"):
        MSE()(torch.zeros(2, 3), torch.zeros(2, 2))


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
        build_metrics("classification", cfg, spec("classification", 5), loss),
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
        build_metrics("classification", cfg, spec("classification", 2), CrossEntropy()),
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
    metrics = build_metrics("multilabel", TrainConfig(), spec("multilabel", 4), BCE())

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
    got = run_metrics(build_metrics("multilabel", TrainConfig(), spec("multilabel", 0), BCE()), [(logits, y)])

    # Assert
    assert got["auc"] == pytest.approx(skm.roc_auc_score(y, torch.sigmoid(logits[:, 0])), abs=AUC_TOL)
    assert got["loss"] == pytest.approx(F.binary_cross_entropy_with_logits(logits[:, 0], y).item(), rel=1e-6)


def test_regression_metrics_match_sklearn() -> None:
    # Prepare: 2 outputs
    torch.manual_seed(6)
    y = torch.randn(200, 2) * torch.tensor([1.0, 5.0])
    pred = y + torch.randn(200, 2)
    metrics = build_metrics("regression", TrainConfig(), spec("regression", 2), MSE())

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
    got = run_metrics(build_metrics("ranking", cfg, spec("ranking"), ListNet()), [(scores, target)])

    # Assert
    assert got["ndcg@3"] == pytest.approx((0.574141 + 0.630930) / 2, abs=1e-6)
    assert got["loss"] == pytest.approx(listnet(scores, target).item(), rel=1e-6)


def test_lm_perplexity_is_exp_of_token_mean_loss() -> None:
    # Prepare
    torch.manual_seed(7)
    logits, tokens = torch.randn(6, 5, 11), torch.randint(0, 11, (6, 5))

    # Execute
    got = run_metrics(
        build_metrics("lm", TrainConfig(), spec("lm", 11), CrossEntropy()),
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
    data = spec("multitask", heads={"r": TargetSpec("regression", 1), "c": TargetSpec("classification", 3)})
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
    mt_spec = spec("multitask", heads={"r": TargetSpec("regression", 2), "m": TargetSpec("multilabel", 3)})
    return {
        "binary": ("classification", TrainConfig(), spec("classification", 2), CrossEntropy(),
                   torch.randn(n, 2), torch.randint(0, 2, (n,))),
        "multiclass": ("classification", TrainConfig(), spec("classification", 4), CrossEntropy(),
                       torch.randn(n, 4), torch.randint(0, 4, (n,))),
        "multilabel": ("multilabel", TrainConfig(), spec("multilabel", 3), BCE(),
                       torch.randn(n, 3), (torch.rand(n, 3) < 0.4).float()),
        "regression": ("regression", TrainConfig(), spec("regression", 2), Huber(),
                       torch.randn(n, 2), torch.randn(n, 2)),
        "ranking": ("ranking", TrainConfig(ndcg_k=2), spec("ranking"), ListNet(),
                    torch.randn(n, 5), torch.randint(-1, 3, (n, 5)).float()),
        "lm": ("lm", TrainConfig(), spec("lm", 6), CrossEntropy(),
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
    unknown = build_metrics("classification", TrainConfig(), spec("classification", 0), CrossEntropy())
    preset = build_metrics("classification", TrainConfig(), spec("classification", 0), CrossEntropy())
    preset.num_classes = 3  # what the trainer does when it knows the model's width

    # Execute / Assert
    with pytest.raises(RuntimeError, match=r"set metrics.num_classes"):
        unknown.state()
    unknown.update(torch.randn(4, 3), torch.tensor([0, 1, 2, 0]))
    assert unknown.num_classes == 3
    assert unknown.state().numel() == preset.state().numel() == 2 + 9


# ---------------------------------------------------------------- build_loss


@pytest.mark.parametrize(
    ("task", "loss", "expected"),
    [
        ("classification", "auto", CrossEntropy),
        ("lm", "auto", CrossEntropy),
        ("multilabel", "auto", BCE),
        ("regression", "auto", MSE),
        ("ranking", "auto", ListNet),
        ("regression", "huber", Huber),
        ("classification", "bce", BCE),
    ],
)
def test_build_loss_builtins(task: str, loss: str, expected: type) -> None:
    # Prepare / Execute
    built = build_loss(TrainConfig(loss=loss), spec(task, 3))

    # Assert
    assert type(built) is expected


def test_default_loss_per_task() -> None:
    expected = {
        "classification": "cross_entropy",
        "lm": "cross_entropy",
        "multilabel": "bce",
        "regression": "mse",
        "ranking": "listnet",
        "multitask": "multitask",
    }
    assert {task: default_loss(task) for task in expected} == expected


def test_build_loss_takes_settings_from_train_config() -> None:
    # Prepare
    data = spec("classification", 3)

    # Execute
    ce = build_loss(TrainConfig(label_smoothing=0.1, class_weights=[1.0, 2.0, 3.0]), data)
    bce = build_loss(TrainConfig(loss="bce", class_weights=[1.0, 2.0, 3.0]), spec("multilabel", 3))
    huber = build_loss(TrainConfig(loss="huber", huber_delta=0.25), spec("regression", 1))
    mt = build_loss(TrainConfig(multitask={"heads": {"a": {}}}), spec("multitask"))

    # Assert
    assert isinstance(ce, CrossEntropy) and ce.label_smoothing == 0.1
    assert ce.weight is not None and ce.weight.tolist() == [1.0, 2.0, 3.0]
    assert "weight" in dict(ce.named_buffers())
    assert isinstance(bce, BCE) and bce.pos_weight is not None and bce.pos_weight.tolist() == [1.0, 2.0, 3.0]
    assert isinstance(huber, Huber) and huber.delta == 0.25
    assert isinstance(mt, MultiTask) and isinstance(mt.losses["a"], MSE)
    assert resolve_task("auto", spec("ranking")) == "ranking"
    assert resolve_task("regression", spec("ranking")) == "regression"
    with pytest.raises(ConfigError, match=r"train.class_weights: 2 weights, but the data has 3 classes"):
        build_loss(TrainConfig(class_weights=[1.0, 2.0]), data)
    with pytest.raises(ConfigError, match=r"train.loss_kwargs: only for an import-string train.loss"):
        build_loss(TrainConfig(loss="mse", loss_kwargs={"x": 1}), data)


USER_MODULE = """
import torch
from torch import nn

NUMBER = 3


def scaled_l1(output, target, scale=1.0):
    return scale * (output - target).abs().mean()


def no_args():
    return 0


class Pinball(nn.Module):
    def __init__(self, q=0.5):
        super().__init__()
        self.q = q

    def forward(self, output, target):
        e = target - output
        return torch.maximum(self.q * e, (self.q - 1) * e).mean()


def penalty(output, target):
    return output["a"].abs().sum()
"""


@pytest.fixture
def user_losses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    name = f"user_losses_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(USER_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_build_loss_from_user_function_and_class(user_losses: str) -> None:
    # Prepare
    data = spec("regression", 1)
    out, y = torch.tensor([1.0, 3.0]), torch.tensor([2.0, 2.0])

    # Execute
    fn = build_loss(TrainConfig(loss=f"{user_losses}:scaled_l1", loss_kwargs={"scale": 3.0}), data)
    cls = build_loss(TrainConfig(loss=f"{user_losses}:Pinball", loss_kwargs={"q": 0.9}), data)

    # Assert
    assert isinstance(fn, FunctionLoss) and isinstance(fn, nn.Module)
    assert fn(out, y).item() == pytest.approx(3.0)
    assert type(cls).__name__ == "Pinball" and cls.q == 0.9
    assert cls(out, y).item() == pytest.approx((0.9 * 1 + 0.1 * 1) / 2)


@pytest.mark.parametrize(
    ("attr", "kwargs", "message"),
    [
        ("NUMBER", {}, r"train.loss: '{m}:NUMBER' is the int 3, not a loss function or class"),
        ("missing", {}, r"train.loss: '{m}' has no attribute 'missing'"),
        ("no_args", {}, r"train.loss: cannot call '{m}:no_args' as fn\(output, target"),
        ("Pinball", {"bad": 1}, r"train.loss: cannot call 'Pinball'"),
    ],
)
def test_bad_user_losses_are_config_errors(user_losses: str, attr: str, kwargs: dict, message: str) -> None:
    # Prepare
    cfg = TrainConfig(loss=f"{user_losses}:{attr}", loss_kwargs=kwargs)

    # Execute / Assert
    with pytest.raises(ConfigError, match=message.format(m=user_losses)):
        build_loss(cfg, spec("regression", 1))


def test_missing_loss_module_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"train.loss: cannot import module 'no_such_module_vatra'"):
        build_loss(TrainConfig(loss="no_such_module_vatra:fn"), spec("regression", 1))


def test_multitask_from_config_with_user_head_loss_and_penalty(user_losses: str) -> None:
    # Prepare
    cfg = TrainConfig(
        multitask={
            "heads": {"a": {"loss": f"{user_losses}:scaled_l1"}, "b": {"task": "multilabel"}},
            "penalties": [{"fn": f"{user_losses}:penalty", "weight": 0.5}],
        }
    )
    output = {"a": torch.tensor([1.0, -1.0]), "b": torch.tensor([0.0, 0.0])}
    target = {"a": torch.tensor([0.0, 0.0]), "b": torch.tensor([1.0, 0.0])}

    # Execute
    loss = build_loss(cfg, spec("multitask"))

    # Assert: |e| mean 1 + BCE(0 logits) log 2 + 0.5 · Σ|a| = 1
    assert isinstance(loss, MultiTask) and isinstance(loss.losses["b"], BCE)
    assert loss(output, target).item() == pytest.approx(1.0 + math.log(2) + 1.0, rel=1e-6)
    bad = TrainConfig(multitask={"heads": {"a": {}}, "penalties": [{"fn": f"{user_losses}:NUMBER"}]})
    with pytest.raises(
        ConfigError, match=r"train.multitask.penalties\[0\].fn: .* is the int 3, not a function"
    ):
        build_loss(bad, spec("multitask"))
