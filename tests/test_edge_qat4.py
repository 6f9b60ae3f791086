"""[edge] qat = "int4w" (torchao's QATConfig) and prune = "structured" inside training, under DDP too."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
from tests._dist import spawn
from tests.conftest import small_config
from torch import nn

from vatra.compress import EdgeTraining, count_parameters, prune_model
from vatra.compress.qat4 import convert_int4w, is_int4w_prepared
from vatra.data import ShardSampler
from vatra.engine import DistContext, Trainer, seed_everything
from vatra.models import build_model

STEPS, LOCAL_BATCH, WORLD = 6, 8, 2
MODEL = {"name": "mlp", "hidden": [64, 32]}
EDGE = {
    "qat": "int4w",
    "qat_start_step": 2,  # two float steps, then torchao swaps the layers under a live DDP wrapper
    "prune": "structured",
    "sparsity": 0.5,
    "prune_schedule": "gradual",
    "prune_start_step": 1,
    "prune_end_step": 4,
    "prune_every": 1,
}


def make_trainer(
    indices: np.ndarray, batch_size: int, ctx: DistContext | None, edge: dict, model: dict = MODEL
) -> Trainer:
    cfg = small_config(
        model=model,
        train={"steps": STEPS, "batch_size": batch_size},
        optim={"name": "sgd", "lr": 0.05, "momentum": 0.9},  # momentum: optimizer state over the swap
        edge=edge,
    )
    base = Trainer.from_config(cfg)  # dataset and spec only
    seed_everything(cfg.run.seed)
    net = build_model(cfg.model, base.spec)
    sampler = ShardSampler(indices, batch_size, seed=0, shuffle=False)
    plugins = [EdgeTraining(cfg.edge, cfg.train.steps)]
    return Trainer(cfg, net, base.train_data, base.val_data, base.spec, sampler, dist=ctx, plugins=plugins)


def rank_indices(rank: int) -> np.ndarray:
    """Rank r's slice of every global batch: global batch i = [i*W*B, (i+1)*W*B)."""
    glob = np.arange(STEPS * WORLD * LOCAL_BATCH).reshape(STEPS, WORLD, LOCAL_BATCH)
    return glob[:, rank, :].reshape(-1)


def _worker(rank: int, init_file: str, out_dir: str, edge: dict) -> None:
    torch.set_num_threads(1)
    ctx = DistContext.init(
        small_config().dist, rank=rank, world_size=WORLD, init_method=f"file://{init_file}"
    )
    try:
        trainer = make_trainer(rank_indices(rank), LOCAL_BATCH, ctx, edge)
        trainer.fit()
        torch.save([p.detach() for p in trainer.model.parameters()], Path(out_dir) / f"rank{rank}.pt")
    finally:
        ctx.destroy()


@pytest.mark.slow(20)  # two spawned ranks and two reference runs
def test_int4w_qat_and_structured_pruning_on_two_ranks_equal_one_process_on_the_union_batch(
    tmp_path: Path,
) -> None:
    # Execute: 2 DDP ranks, one process on both ranks' rows per step, and that without QAT
    spawn(_worker, WORLD, (str(tmp_path / "rdzv"), str(tmp_path), EDGE))
    union = np.arange(STEPS * WORLD * LOCAL_BATCH)
    reference = make_trainer(union, WORLD * LOCAL_BATCH, None, EDGE)
    reference.fit()
    no_qat = make_trainer(union, WORLD * LOCAL_BATCH, None, {**EDGE, "qat": "none"})
    no_qat.fit()
    # Assert: both ranks hold the same replica, and it is the one process's weights. Without QAT
    # they differ by fp32 summation order only (~1e-8: a matmul over 8 rows vs 16, DDP's mean of
    # means). torchao's int4 weight fake quantizer sits each group's largest positive weight at
    # +7.5 grid steps, where that noise decides whether it rounds to 8 (clamped: its gradient
    # masked to 0) or to 7 (gradient 1): a few weights per step get or lose their whole gradient.
    # Over 4 QAT steps that measured ~5e-4, a tenth of what QAT changes: 2e-3 and a fifth of it
    assert is_int4w_prepared(reference.model)
    want = [p.detach() for p in reference.model.parameters()]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    for a, b in zip(*ranks, strict=True):
        assert torch.equal(a, b)
    gap = max(float((g - w).abs().max()) for g, w in zip(ranks[0], want, strict=True))
    qat_effect = max(
        float((p.detach() - w).abs().max()) for p, w in zip(no_qat.model.parameters(), want, strict=True)
    )
    assert gap < 2e-3 and gap < qat_effect / 5
    # half the neurons of each hidden layer are cut: zero rows in, zero columns out, held to the end
    w0, b0, w1, b1, w2, _ = want
    assert torch.equal(b1 == 0, w1.abs().sum(dim=1) == 0)
    assert int((w0.abs().sum(dim=1) == 0).sum()) == 32 and int((w1.abs().sum(dim=1) == 0).sum()) == 16
    assert torch.equal(b0 == 0, w0.abs().sum(dim=1) == 0)
    assert torch.equal(w1.abs().sum(dim=0) == 0, w0.abs().sum(dim=1) == 0)
    assert torch.equal(w2.abs().sum(dim=0) == 0, w1.abs().sum(dim=1) == 0)


def test_int4w_converted_model_equals_the_fake_quantized_one() -> None:
    # Prepare: a run with int4w QAT from its first step
    trainer = make_trainer(np.arange(96), 16, None, {"qat": "int4w"})
    # Execute: fit (QAT's convert step runs on a copy at the end), and convert again here
    summary = trainer.fit()
    model = trainer.model.eval()
    x = trainer.train_data.get_batch(np.arange(96))[0]  # (96, 64): digits' 8×8 pixels
    converted = convert_int4w(copy.deepcopy(model)).eval()
    float_model = make_trainer(np.arange(16), 16, None, {}).model  # plain Linear layers
    float_model.load_state_dict(model.state_dict())  # the trained float weights (same keys)
    ptq = convert_int4w(float_model).eval()  # quantized after training, as PTQ would
    # Assert: torchao's int4 layers give the fake-quantized model's outputs (float rounding of the
    # accumulation only: 1e-5), the run recorded the same check, and int4 is not the float model
    assert "Intx" in type(converted.trunk[0].weight).__name__
    with torch.no_grad():
        fq, got = model(x), converted(x)
        flt = nn.functional.linear(  # the float first layer alone: int4 rounding is visible there
            x, model.trunk[0].weight, model.trunk[0].bias
        )
        assert float((flt - converted.trunk[0](x)).abs().max()) > 1e-3
        torch.testing.assert_close(ptq(x), got, rtol=0, atol=1e-6)  # PTQ of the weights = convert
    torch.testing.assert_close(got, fq, rtol=0, atol=1e-5)
    edge = summary["edge"]["converted"]
    assert edge["layers"] == 3 and edge["max_abs_diff_vs_fake_quant"] < 1e-5


def test_structured_pruning_in_training_is_removed_exactly_at_export() -> None:
    # Prepare: a one-shot cut at step 2, then fine-tuning with the cut neurons held at zero
    edge = {"prune": "structured", "sparsity": 0.75, "prune_schedule": "oneshot", "prune_start_step": 2}
    trainer = make_trainer(np.arange(96), 16, None, edge)
    trainer.fit()
    model = trainer.model.eval()
    x = trainer.train_data.get_batch(np.arange(96))[0]
    # Execute: what `vatra edge export --prune structured --sparsity 0.75` does to the weights
    small = prune_model(copy.deepcopy(model), "structured", 0.75)
    # Assert: 64 -> 16 and 32 -> 8 neurons, counted; the removed ones were exactly the zeroed ones
    widths = [m.out_features for m in small.modules() if isinstance(m, nn.Linear)]
    assert widths == [16, 8, 10]
    total, nonzero = count_parameters(small)
    assert total == nonzero == (64 * 16 + 16) + (16 * 8 + 8) + (8 * 10 + 10)
    assert count_parameters(model)[0] == (64 * 64 + 64) + (64 * 32 + 32) + (32 * 10 + 10)
    with torch.no_grad():
        torch.testing.assert_close(small(x), model(x), rtol=0, atol=1e-5)


def test_a_cnn_loses_channels_and_still_trains() -> None:
    # Prepare: the digits cnn (conv 16 -> conv 32 -> global pool -> Linear 10)
    trainer = make_trainer(np.arange(128), 32, None, {}, model={"name": "cnn", "channels": [16, 32]})
    model = trainer.model
    before, _ = count_parameters(model)
    x, y = trainer.train_data.get_batch(np.arange(128))
    # Execute
    pruned = prune_model(copy.deepcopy(model), "structured", 0.5)
    # Assert: 8 and 16 channels left, the next layers' inputs cut to match
    convs = [m for m in pruned.modules() if isinstance(m, nn.Conv2d)]
    head = next(m for m in pruned.modules() if isinstance(m, nn.Linear))
    assert [(c.in_channels, c.out_channels) for c in convs] == [(1, 8), (8, 16)] and head.in_features == 16
    after, nonzero = count_parameters(pruned)
    assert after == nonzero == (1 * 8 * 9 + 8) + (8 * 16 * 9 + 16) + (16 * 10 + 10) < before / 3
    opt = torch.optim.Adam(pruned.parameters(), lr=0.01)
    losses = []
    for _ in range(40):
        loss = nn.functional.cross_entropy(pruned(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.7 * losses[0]


@pytest.mark.slow(15)  # a cnn trained on PNG files, then exported and measured
def test_a_cnn_pruned_in_training_on_an_image_folder_exports_smaller(tmp_path: Path) -> None:
    # Prepare: 10 classes × 12 PNG images (8×8 grayscale, each class its own bright pixel)
    from PIL import Image

    import vatra
    from vatra.edge import Recipe, edge_export

    rng = np.random.default_rng(0)
    for c in range(10):
        (tmp_path / "img" / str(c)).mkdir(parents=True)
        for i in range(12):
            pixels = rng.integers(0, 60, (8, 8), dtype=np.uint8)
            pixels[c % 8, c // 8 * 4 + 2] = 255
            Image.fromarray(pixels, mode="L").save(tmp_path / "img" / str(c) / f"{i}.png")
    data = {"name": "images", "path": str(tmp_path / "img"), "image_size": [8, 8], "image_mode": "L"}
    edge = {"prune": "structured", "sparsity": 0.5, "prune_schedule": "oneshot", "prune_start_step": 5}
    cfg = small_config(
        run={"out_dir": str(tmp_path / "runs")},
        data=data | {"val_fraction": 0.25},
        model={"name": "cnn", "channels": [8, 16]},
        train={"steps": 20, "batch_size": 16},
        optim={"name": "adamw", "lr": 0.01},
        edge=edge,
    )
    result = vatra.fit(cfg)
    # Execute: the export removes the channels training held at zero
    folder, report = edge_export(
        result.run_dir, tmp_path / "m", "onnx", Recipe("none", "structured", 0.5), calls=5
    )
    # Assert: half the channels of each conv gone (counted), outputs the trained model's
    fp32, pruned = report["variants"]
    full = (1 * 8 * 9 + 8) + (8 * 16 * 9 + 16) + (16 * 10 + 10)
    assert fp32["parameters"] == full
    assert (
        pruned["parameters"]
        == pruned["nonzero_parameters"]
        == (1 * 4 * 9 + 4) + (4 * 8 * 9 + 8) + (8 * 10 + 10)
    )
    assert pruned["size_bytes"] < 0.6 * fp32["size_bytes"]  # 30 % of the parameters, plus the graph
    assert pruned["accuracy"] == fp32["accuracy"]  # removing zeroed channels changes no output
    assert pruned["max_abs_diff_vs_fp32"] < 1e-4
    assert vatra.load(folder).meta["weights"] == "onnx"


def test_the_export_prunes_as_the_run_trained_unless_told_otherwise(tmp_path: Path) -> None:
    # Prepare: run folders as vatra writes them (config.toml holds the resolved [edge] section)
    from vatra.cli.edge import trained_pruning

    def run(edge: str) -> Path:
        folder = tmp_path / str(len(list(tmp_path.iterdir())))
        folder.mkdir()
        (folder / "config.toml").write_text(f"[train]\nsteps = 10\n\n[edge]\n{edge}\n")
        return folder

    structured = run('prune = "structured"\nsparsity = 0.75')
    plain = run('prune = "none"\nsparsity = 0.5')
    # Execute / Assert: no flags: the run's own cut; a flag wins; another method keeps 0.5
    assert trained_pruning(structured, None, None) == ("structured", 0.75)
    assert trained_pruning(structured, "structured", 0.5) == ("structured", 0.5)
    assert trained_pruning(structured, "magnitude", None) == ("magnitude", 0.5)
    assert trained_pruning(plain, None, None) == ("none", 0.5)
    assert trained_pruning(tmp_path / "missing", None, None) == ("none", 0.5)
