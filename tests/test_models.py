"""Built-in models: output shapes, seeded determinism, and that a few steps reduce the loss."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from vatra.config import DataConfig, ModelConfig
from vatra.data import DatasetSpec, Split, build_dataset
from vatra.errors import ConfigError
from vatra.losses import CrossEntropy
from vatra.models import GPT, build_model
from vatra.registry import MODELS

TINY = {
    "mlp": ModelConfig(name="mlp", hidden=[32, 32]),
    "cnn": ModelConfig(name="cnn", channels=[8, 16]),
    "gpt": ModelConfig(name="gpt", n_layer=1, n_head=2, n_embd=32),
}
DIGITS = DatasetSpec("classification", (64,), 10, (1, 8, 8))
SYNTHETIC = DatasetSpec("classification", (12,), 4, None)
TEXT = DatasetSpec("lm", (16,), 256, None)


@pytest.fixture(scope="module")
def digits() -> Split:
    train, _, _ = build_dataset(DataConfig(name="digits"), 0)
    return train


@pytest.fixture(scope="module")
def text() -> Split:
    train, _, _ = build_dataset(DataConfig(name="text", max_chars=20_000, block_size=16), 0)
    return train


def _build(name: str, spec: DatasetSpec, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return build_model(TINY[name], spec)


def _inputs(spec: DatasetSpec, batch: int = 5) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    if spec.kind == "lm":
        return torch.randint(0, spec.num_classes, (batch, *spec.input_shape), generator=gen)
    return torch.rand(batch, *spec.input_shape, generator=gen)


@pytest.mark.parametrize(
    ("name", "spec", "out_shape"),
    [
        ("mlp", DIGITS, (5, 10)),
        ("mlp", SYNTHETIC, (5, 4)),
        ("cnn", DIGITS, (5, 10)),
        ("gpt", TEXT, (5, 16, 256)),
    ],
)
def test_output_shapes(name: str, spec: DatasetSpec, out_shape: tuple[int, ...]) -> None:
    model = _build(name, spec)

    logits = model(_inputs(spec))

    assert logits.shape == out_shape


def test_gpt_accepts_sequences_shorter_than_block_and_ties_the_head() -> None:
    model = _build("gpt", TEXT)
    assert isinstance(model, GPT)

    logits = model(torch.zeros(2, 5, dtype=torch.int64))

    assert logits.shape == (2, 5, 256)
    assert model.head.weight is model.tok_emb.weight
    with pytest.raises(ValueError, match="exceeds block_size 16"):
        model(torch.zeros(1, 17, dtype=torch.int64))


def test_gpt_is_causal() -> None:
    model = _build("gpt", TEXT).eval()
    x = _inputs(TEXT, batch=1)
    changed = x.clone()
    changed[0, 10] = (changed[0, 10] + 1) % 256

    before, after = model(x), model(changed)

    # Positions before the change see the same prefix; tolerance covers float reordering only.
    torch.testing.assert_close(before[:, :10], after[:, :10], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(before[:, 10:], after[:, 10:])


@pytest.mark.parametrize(("name", "spec"), [("mlp", DIGITS), ("cnn", DIGITS), ("gpt", TEXT)])
def test_models_are_deterministic_under_seed(name: str, spec: DatasetSpec) -> None:
    a, b, c = _build(name, spec, seed=7), _build(name, spec, seed=7), _build(name, spec, seed=8)
    x = _inputs(spec)

    for (key, pa), pb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        torch.testing.assert_close(pa, pb, rtol=0, atol=0, msg=key)
    torch.testing.assert_close(a(x), b(x), rtol=0, atol=0)
    assert not torch.equal(a(x), c(x))


@pytest.mark.parametrize(
    ("name", "spec", "match"),
    [
        ("cnn", SYNTHETIC, "'cnn' needs image inputs"),
        ("mlp", TEXT, "'mlp' does not model language"),
        ("cnn", TEXT, "'cnn' needs image inputs"),
        ("gpt", DIGITS, "'gpt' needs a language-modelling dataset"),
    ],
)
def test_model_dataset_mismatch_is_a_config_error(name: str, spec: DatasetSpec, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        build_model(TINY[name], spec)


def test_registry_and_unknown_model() -> None:
    assert MODELS.names() == ["cnn", "gpt", "mlp"]
    with pytest.raises(ConfigError, match="unknown model 'vit'; choose one of: cnn, gpt, mlp"):
        build_model(ModelConfig.model_construct(name="vit"), DIGITS)


def test_cross_entropy_is_the_same_for_classification_and_lm_shapes() -> None:
    cls_logits = torch.tensor([[2.0, 0.0], [0.0, 1.0], [3.0, 0.0]])
    lm_logits = cls_logits.reshape(1, 3, 2)  # (B, T, V)
    targets = torch.tensor([0, 0, 0])
    loss_fn = CrossEntropy()

    torch.testing.assert_close(loss_fn(lm_logits, targets[None]), loss_fn(cls_logits, targets))


def _train(
    model: nn.Module, split: Split, optimizer: torch.optim.Optimizer, steps: int
) -> tuple[float, float]:
    """Loss on a fixed batch before and after ``steps`` optimizer steps on random batches."""
    rng = np.random.default_rng(0)
    loss_fn = CrossEntropy()
    fixed = split.get_batch(np.arange(256))
    with torch.no_grad():
        before = loss_fn(model(fixed[0]), fixed[1]).item()
    for _ in range(steps):
        x, y = split.get_batch(rng.integers(0, len(split), size=64))
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()
    with torch.no_grad():
        after = loss_fn(model(fixed[0]), fixed[1]).item()
    return before, after


@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_sgd_steps_reduce_loss_on_digits(name: str, digits: Split) -> None:
    model = _build(name, DIGITS)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    before, after = _train(model, digits, optimizer, steps=100)

    assert after < 0.5 * before, (before, after)


def test_gpt_steps_reduce_loss_on_text(text: Split) -> None:
    model = _build("gpt", TEXT)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)

    before, after = _train(model, text, optimizer, steps=30)

    assert before == pytest.approx(np.log(256), rel=0.05)  # small init: near-uniform start
    assert after < 0.7 * before, (before, after)
