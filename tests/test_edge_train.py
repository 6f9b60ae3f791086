"""[edge] inside training: int8 QAT (under DDP too) converted by torchao; magnitude pruning on a schedule."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
from tests._dist import spawn
from tests.conftest import small_config
from torch import nn

from vatra.compress import EdgeTraining, is_prepared, magnitude_masks, remove_qat, scheduled_sparsity
from vatra.config import EdgeConfig
from vatra.data import ShardSampler
from vatra.edge import torchao_quantize
from vatra.engine import DistContext, Trainer, seed_everything
from vatra.models import build_model
from vatra.rundir import RunDir, read_jsonl

STEPS, LOCAL_BATCH, WORLD = 4, 8, 2
EDGE = {
    "qat": "int8",
    "qat_start_step": 1,
    "prune": "magnitude",
    "sparsity": 0.5,
    "prune_schedule": "oneshot",
}


def make_trainer(
    indices: np.ndarray, batch_size: int, ctx: DistContext | None, edge: dict, accum: int = 1
) -> Trainer:
    train = {"steps": STEPS, "batch_size": batch_size, "grad_accum": accum}
    cfg = small_config(train=train, optim={"name": "sgd", "lr": 0.5}, edge=edge)
    base = Trainer.from_config(cfg)  # dataset and spec only
    seed_everything(cfg.run.seed)
    model = build_model(cfg.model, base.spec)
    sampler = ShardSampler(indices, batch_size, seed=0, shuffle=False)
    plugins = [EdgeTraining(cfg.edge, cfg.train.steps)]
    return Trainer(cfg, model, base.train_data, None, base.spec, sampler, dist=ctx, plugins=plugins)


def rank_indices(rank: int) -> np.ndarray:
    """Rank r's slice of every global batch: global batch i = [i*W*B, (i+1)*W*B)."""
    glob = np.arange(STEPS * WORLD * LOCAL_BATCH).reshape(STEPS, WORLD, LOCAL_BATCH)
    return glob[:, rank, :].reshape(-1)


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    ctx = DistContext.init(
        small_config().dist, rank=rank, world_size=WORLD, init_method=f"file://{init_file}"
    )
    try:
        trainer = make_trainer(rank_indices(rank), LOCAL_BATCH, ctx, EDGE)
        trainer.fit()
        torch.save([p.detach() for p in trainer.model.parameters()], Path(out_dir) / f"rank{rank}.pt")
    finally:
        ctx.destroy()


@pytest.mark.slow(20)  # two spawned ranks and two reference runs
def test_qat_and_pruning_on_two_ranks_equal_one_process_on_the_union_batch(tmp_path: Path) -> None:
    # Execute: 2 DDP ranks, and one process on both ranks' rows per step, accumulated over the two
    # ranks' halves in order (grad_accum 2): the same products as the ranks' (a batch of 16 rows
    # rounds differently from two of 8 on some CPUs, and a fake-quantized weight that lands on a
    # rounding tie then moves by a whole step: 2.6e-4 of the weights' norm on AMD EPYC, a quarter
    # of what QAT changes in these 4 steps), and DDP's mean g₀/2 + g₁/2 is the accumulated sum
    union = np.arange(STEPS * WORLD * LOCAL_BATCH)
    spawn(_worker, WORLD, (str(tmp_path / "rdzv"), str(tmp_path)))
    reference = make_trainer(union, LOCAL_BATCH, None, EDGE, accum=WORLD)
    reference.fit()
    plain = make_trainer(union, LOCAL_BATCH, None, {}, accum=WORLD)
    plain.fit()
    # Assert: the same weights (the same arithmetic: a last-bit difference at most)
    assert is_prepared(reference.model)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    want = [p.detach() for p in reference.model.parameters()]
    for r in range(WORLD):
        for got, w in zip(ranks[r], want, strict=True):
            torch.testing.assert_close(got, w, rtol=1e-6, atol=1e-7)
    linear_w = [p for p in want if p.dim() == 2]
    zeros = sum(int((p == 0).sum()) for p in linear_w) / sum(p.numel() for p in linear_w)
    assert zeros == pytest.approx(0.5, abs=1e-3)  # the cut weights stayed zero through the updates
    start = make_trainer(np.arange(8), 8, None, {}).model  # the same initial weights (same seed)
    cut = magnitude_masks(start, 0.5)  # the one-shot cut at step 0
    for w in cut:  # the kept weights trained on after the cut (the optimizer holds the pruned ones)
        trained = next(p for p in want if p.shape == w.shape)
        assert not torch.equal(trained, w.detach())
    trained_plain = [p.detach() for p in plain.model.parameters()]
    assert not all(torch.equal(a, b) for a, b in zip(want, trained_plain, strict=True))  # QAT did act


def test_converted_int8_model_equals_the_fake_quantized_one() -> None:
    # Prepare: a QAT-trained model (fake quantization from the first step)
    trainer = make_trainer(np.arange(64), 16, None, {"qat": "int8"})
    trainer.fit()
    model = trainer.model.eval()
    x = trainer.train_data.get_batch(np.arange(64))[0]  # (64, 64): digits' 8×8 pixels
    # Execute: torchao's int8 conversion of the same float weights
    fp32 = copy.deepcopy(model)
    remove_qat(fp32)
    converted = torchao_quantize(copy.deepcopy(fp32), "dynamic", None)
    # Assert: layer by layer, the int8 kernel gives the fake-quantized layer's output (float
    # rounding of the accumulation only), and both differ from the float layer
    h = x
    for fq_layer, int8_layer, float_layer in zip(
        [*model.trunk, model.head], [*converted.trunk, converted.head], [*fp32.trunk, fp32.head], strict=True
    ):
        with torch.no_grad():
            want, got, flt = fq_layer(h), int8_layer(h), float_layer(h)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        if isinstance(float_layer, nn.Linear):
            assert float((flt - want).abs().max()) > 1e-4
        h = want


def test_the_gradual_schedule_rises_to_the_sparsity_and_oneshot_jumps() -> None:
    gradual = EdgeConfig(prune="magnitude", sparsity=0.8, prune_start_step=10, prune_end_step=110)
    values = [scheduled_sparsity(gradual, s, 200) for s in (0, 10, 60, 110, 150)]
    assert values == pytest.approx([0.0, 0.0, 0.8 * (1 - 0.5**3), 0.8, 0.8])
    oneshot = gradual.model_copy(update={"prune_schedule": "oneshot"})
    assert [scheduled_sparsity(oneshot, s, 200) for s in (9, 10)] == [0.0, 0.8]
    with pytest.raises(ValueError, match="prune_end_step = 5 is not after"):
        EdgeConfig(prune="magnitude", prune_start_step=10, prune_end_step=5)


@pytest.mark.slow(10)  # a whole vatra.fit with its run folder and checkpoints
def test_gradual_pruning_in_vatra_fit_ends_at_the_sparsity(tmp_path: Path) -> None:
    import vatra

    cfg = small_config(
        run={"out_dir": str(tmp_path)},
        train={"steps": 30},
        edge={"prune": "magnitude", "sparsity": 0.8, "prune_end_step": 20, "prune_every": 5}
        | {"qat": "int8", "qat_start_step": 10},
    )
    result = vatra.fit(cfg)
    assert result.summary["edge"]["sparsity"] == pytest.approx(0.8)
    prepared = [e for e in read_jsonl(RunDir(result.run_dir).events) if e.get("event") == "qat_prepared"]
    assert [(e["step"], e["layers"]) for e in prepared] == [(10, 2)]
    from vatra.serve.weights import load_run_model

    model = load_run_model(result.run_dir).model  # the checkpoint holds the zeros
    weights = torch.cat([m.weight.flatten() for m in model.modules() if isinstance(m, nn.Linear)])
    assert float((weights == 0).float().mean()) == pytest.approx(0.8, abs=1e-3)
