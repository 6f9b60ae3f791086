"""Trainer: the local step without torch.distributed, determinism, accumulation, schedules, plugins."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
import torch
from tests.conftest import small_config

from vatra.config import OptimConfig
from vatra.data import ShardSampler
from vatra.engine import Plugin, Trainer, lr_factor, seed_everything
from vatra.models import build_model


def params(trainer: Trainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer.model.parameters()]


def fixed_trainer(indices: np.ndarray, batch_size: int, **sections: Any) -> Trainer:
    """A trainer whose sampler walks ``indices`` in order (no shuffle): batches are known exactly."""
    cfg = small_config(train={"batch_size": batch_size, **sections.pop("train", {})}, **sections)
    base = Trainer.from_config(cfg)
    sampler = ShardSampler(indices, batch_size, seed=0, shuffle=False)
    seed_everything(cfg.run.seed)
    model = build_model(cfg.model, base.spec)
    return Trainer(cfg, model, base.train_data, base.val_data, base.spec, sampler)


def test_local_step_runs_without_process_group() -> None:
    trainer = Trainer.from_config(small_config(train={"steps": 20, "batch_size": 32}))
    summary = trainer.fit()
    assert summary["steps"] == 20
    assert summary["world_size"] == 1
    assert 0.0 <= summary["val_accuracy"] <= 1.0
    assert not torch.distributed.is_initialized()


def test_same_config_and_seed_give_identical_weights() -> None:
    cfg = small_config(train={"steps": 15}, model={"dropout": 0.2}, optim={"name": "adamw", "lr": 1e-2})
    # from_config seeds the process's RNGs (dropout draws from them): build each trainer just before use.
    a = Trainer.from_config(cfg)
    a.fit()
    b = Trainer.from_config(cfg)
    b.fit()
    for pa, pb in zip(params(a), params(b), strict=True):
        assert torch.equal(pa, pb)
    c = Trainer.from_config(cfg.model_copy(update={"run": cfg.run.model_copy(update={"seed": 1})}))
    c.fit()
    assert not all(torch.equal(pa, pc) for pa, pc in zip(params(a), params(c), strict=True))


def test_gradient_accumulation_matches_one_big_batch() -> None:
    idx = np.arange(64)
    big = fixed_trainer(idx, 16, train={"steps": 4})
    acc = fixed_trainer(idx, 8, train={"steps": 4, "grad_accum": 2})
    big.fit()
    acc.fit()
    # Mean of two half-batch means equals the full-batch mean up to fp32 summation order.
    for pb, pa in zip(params(big), params(acc), strict=True):
        torch.testing.assert_close(pb, pa, rtol=1e-5, atol=1e-6)


def test_clipping_bounds_the_gradient() -> None:
    trainer = fixed_trainer(np.arange(64), 16, train={"clip_grad_norm": 0.01})
    metrics = trainer.train_step()
    assert metrics["grad_norm"] > 0.01  # the reported norm is the pre-clip norm
    clipped = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in trainer.model.parameters()]))
    assert clipped.item() == pytest.approx(0.01, rel=1e-3)


def test_lr_schedules() -> None:
    cfg = OptimConfig(lr=1.0, schedule="cosine", warmup_steps=4, min_lr_ratio=0.1)
    factors = [lr_factor(s, 20, cfg) for s in range(20)]
    assert factors[:4] == pytest.approx([0.2, 0.4, 0.6, 0.8])
    assert factors[4] == pytest.approx(1.0)
    assert all(a >= b for a, b in itertools.pairwise(factors[4:]))
    assert lr_factor(20, 20, cfg) == pytest.approx(0.1)
    assert lr_factor(7, 20, OptimConfig(schedule="constant")) == 1.0


class Recorder(Plugin):
    def __init__(self) -> None:
        self.calls: list[str] = []

    def on_fit_start(self, trainer: Trainer) -> None:
        self.calls.append("fit_start")

    def on_step_start(self, trainer: Trainer) -> None:
        self.calls.append("step_start")

    def after_backward(self, trainer: Trainer) -> None:
        self.calls.append("after_backward")
        trainer.state.skip_update = True  # drop every update: weights must not move

    def on_step_end(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        self.calls.append("step_end")

    def on_eval_end(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        self.calls.append("eval_end")

    def on_fit_end(self, trainer: Trainer, summary: dict[str, Any]) -> None:
        self.calls.append("fit_end")


def test_plugin_call_order_and_skip_update() -> None:
    cfg = small_config(train={"steps": 2})
    rec = Recorder()
    trainer = Trainer.from_config(cfg, plugins=[rec])
    before = params(trainer)
    trainer.fit()
    step = ["step_start", "after_backward", "step_end"]
    # the final evaluation belongs to the last step's record: before that step's on_step_end
    last = ["step_start", "after_backward", "eval_end", "step_end"]
    assert rec.calls == ["fit_start", *step, *last, "fit_end"]
    for pb, pa in zip(before, params(trainer), strict=True):
        assert torch.equal(pb, pa)


class Boom(Plugin):
    def __init__(self) -> None:
        self.failed: BaseException | None = None

    def on_step_end(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        raise RuntimeError("boom")

    def on_failure(self, trainer: Trainer, exc: BaseException) -> None:
        self.failed = exc


def test_failure_reaches_plugins_and_is_raised() -> None:
    boom = Boom()
    with pytest.raises(RuntimeError, match="boom"):
        Trainer.from_config(small_config(), plugins=[boom]).fit()
    assert isinstance(boom.failed, RuntimeError)


def test_bf16_autocast_trains() -> None:
    trainer = Trainer.from_config(small_config(train={"steps": 3, "precision": "bf16"}))
    assert np.isfinite(trainer.fit()["final_loss"])


def test_compile_runs_the_forward_compiled_and_keeps_parameter_names(monkeypatch: pytest.MonkeyPatch) -> None:
    """``train.compile``: forward_backward runs a torch.compile wrapper of the module, while the model
    and its state_dict names stay as without, and so do the losses (within 1e-5: a traced graph may
    order float operations differently). Inductor's C++ build takes ~23 s for one step of a 1-block gpt
    on this 2-core machine, so the wrapper compiles with the ``aot_eager`` backend: dynamo's capture and
    AOTAutograd's forward/backward split, without inductor's generated kernels."""
    # Prepare
    wrapped: list[torch.nn.Module] = []
    graphs: list[torch.fx.GraphModule] = []
    real_compile, aot_eager = torch.compile, torch._dynamo.lookup_backend("aot_eager")

    def backend(graph: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Any:
        graphs.append(graph)
        return aot_eager(graph, example_inputs)

    def compile_aot_eager(module: torch.nn.Module) -> Any:
        wrapped.append(module)
        return real_compile(module, backend=backend)

    monkeypatch.setattr(torch, "compile", compile_aot_eager)
    sections: dict[str, Any] = {
        "data": {"name": "text", "block_size": 16, "max_chars": 20_000},
        "model": {"name": "gpt", "n_layer": 1, "n_head": 2, "n_embd": 16},
        "optim": {"name": "adamw", "lr": 1e-2},
    }
    eager = Trainer.from_config(small_config(**sections))
    compiled = Trainer.from_config(small_config(**sections, train={"compile": True}))
    # Execute
    losses = [(eager.train_step()["loss"], compiled.train_step()["loss"]) for _ in range(2)]
    # Assert
    assert wrapped == [compiled.module] and compiled.model is compiled.module
    assert len(graphs) == 1, "one graph for the whole forward, compiled once"
    assert list(compiled.model.state_dict()) == list(eager.model.state_dict())
    for a, b in losses:
        assert b == pytest.approx(a, rel=1e-5)
    for pa, pb in zip(params(eager), params(compiled), strict=True):
        torch.testing.assert_close(pb, pa, rtol=1e-5, atol=1e-6)
