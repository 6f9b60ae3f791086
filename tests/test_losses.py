"""Losses per task kind against hand computations and torch, and build_loss with users' own losses
(metrics are in test_losses_metrics.py)."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

import pytest
import torch
from tests.conftest import dataset_spec
from torch import nn
from torch.nn import functional as F

from vatra.config._sections import TrainConfig
from vatra.errors import ConfigError
from vatra.losses import (
    BCE,
    MSE,
    CrossEntropy,
    FunctionLoss,
    Huber,
    ListNet,
    MultiTask,
    build_loss,
    default_loss,
    listnet,
    resolve_task,
)

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
    built = build_loss(TrainConfig(loss=loss), dataset_spec(task, 3))

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
    data = dataset_spec("classification", 3)

    # Execute
    ce = build_loss(TrainConfig(label_smoothing=0.1, class_weights=[1.0, 2.0, 3.0]), data)
    bce = build_loss(TrainConfig(loss="bce", class_weights=[1.0, 2.0, 3.0]), dataset_spec("multilabel", 3))
    huber = build_loss(TrainConfig(loss="huber", huber_delta=0.25), dataset_spec("regression", 1))
    mt = build_loss(TrainConfig(multitask={"heads": {"a": {}}}), dataset_spec("multitask"))

    # Assert
    assert isinstance(ce, CrossEntropy) and ce.label_smoothing == 0.1
    assert ce.weight is not None and ce.weight.tolist() == [1.0, 2.0, 3.0]
    assert "weight" in dict(ce.named_buffers())
    assert isinstance(bce, BCE) and bce.pos_weight is not None and bce.pos_weight.tolist() == [1.0, 2.0, 3.0]
    assert isinstance(huber, Huber) and huber.delta == 0.25
    assert isinstance(mt, MultiTask) and isinstance(mt.losses["a"], MSE)
    assert resolve_task("auto", dataset_spec("ranking")) == "ranking"
    assert resolve_task("regression", dataset_spec("ranking")) == "regression"
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
    data = dataset_spec("regression", 1)
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
        build_loss(cfg, dataset_spec("regression", 1))


def test_missing_loss_module_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"train.loss: cannot import module 'no_such_module_vatra'"):
        build_loss(TrainConfig(loss="no_such_module_vatra:fn"), dataset_spec("regression", 1))


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
    loss = build_loss(cfg, dataset_spec("multitask"))

    # Assert: |e| mean 1 + BCE(0 logits) log 2 + 0.5 · Σ|a| = 1
    assert isinstance(loss, MultiTask) and isinstance(loss.losses["b"], BCE)
    assert loss(output, target).item() == pytest.approx(1.0 + math.log(2) + 1.0, rel=1e-6)
    bad = TrainConfig(multitask={"heads": {"a": {}}, "penalties": [{"fn": f"{user_losses}:NUMBER"}]})
    with pytest.raises(
        ConfigError, match=r"train.multitask.penalties\[0\].fn: .* is the int 3, not a function"
    ):
        build_loss(bad, dataset_spec("multitask"))
