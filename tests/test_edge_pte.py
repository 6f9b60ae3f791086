"""vatra edge export: ExecuTorch (.pte, XNNPACK) in its runtime, the report's stages, recovered % and plot."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tests.conftest import small_config, vatra_in_process

import vatra
from vatra.edge import REPORT, Recipe, edge_export, torchao_quantize
from vatra.edge.lower import write_pte
from vatra.edge.measure import validation_rows
from vatra.edge.report import PLOT, recovered
from vatra.serve.folder import MANIFEST, pte_runner
from vatra.serve.weights import load_run_model


def _fit(folder: Path, edge: dict[str, Any]) -> Path:
    cfg = small_config(
        run={"out_dir": str(folder)},
        model={"name": "mlp", "hidden": [64]},
        train={"steps": 40, "batch_size": 32},
        optim={"name": "adamw", "lr": 0.003},
        edge=edge,
    )
    return vatra.fit(cfg).run_dir


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A float run and an int8 QAT run of the digits MLP (64 → 64 → 10), same seed and rows."""
    folder = tmp_path_factory.mktemp("edge-pte")
    return {"fp32": _fit(folder, {}), "qat": _fit(folder, {"qat": "int8", "qat_start_step": 20})}


@pytest.mark.slow(40)  # two ExecuTorch lowerings (torch.export + XNNPACK): 5-15 s each here
def test_executorch_export_runs_in_its_runtime_and_matches_pytorch(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    # Prepare: the run's float model and the torchao int4w model, in PyTorch
    pytest.importorskip("executorch")
    run = runs["fp32"]
    rm = load_run_model(run)
    rows = validation_rows(rm, run)
    x = torch.from_numpy(rows.inputs["x"])
    with torch.no_grad():
        fp32 = rm.model(x).numpy()
        int4w = torchao_quantize(copy.deepcopy(rm.model), "int4w", None)(x).numpy()
    # Execute
    folder, report = edge_export(run, tmp_path / "m", "executorch", Recipe(quant="int4w"), calls=5)
    # Assert: each variant is a .pte the ExecuTorch runtime ran (vatra.load's runner), measured
    by = {v["variant"]: v for v in report["variants"]}
    assert set(by) == {"fp32", "int4w"} and report["chosen"] == "int4w" and (folder / "model.pte").is_file()
    assert by["int4w"]["size_bytes"] < 0.4 * by["fp32"]["size_bytes"]
    for v in by.values():
        assert v["latency_ms_batch1"]["p50"] > 0 and v["latency_ms_batch32"]["p50"] > 0
    # fp32 on XNNPACK is PyTorch up to float rounding; int4w within its quantization error
    assert by["fp32"]["max_abs_diff_vs_fp32"] < 1e-4
    assert 1e-3 < by["int4w"]["max_abs_diff_vs_fp32"] < 1.0
    assert abs(by["int4w"]["accuracy"] - by["fp32"]["accuracy"]) <= 0.05
    predictor = vatra.load(folder)
    assert predictor.meta["weights"] == "executorch"
    got = predictor.runner(rows.inputs)  # all the rows at once: the batch dimension is dynamic
    # the program computes torchao's int4w model (XNNPACK's int8 activation kernel rounds its own
    # way: ~4e-3 measured), far closer than either is to fp32
    np.testing.assert_allclose(got, int4w, rtol=0, atol=0.02)
    assert float(np.abs(got - fp32).max()) > 2 * float(np.abs(got - int4w).max())
    np.testing.assert_allclose(predictor.runner(rows.head(1)), got[:1], rtol=0, atol=1e-5)
    manifest = json.loads((folder / MANIFEST).read_text())
    assert manifest["weights"] == {"format": "executorch", "file": "model.pte"}


@pytest.mark.slow(20)  # one ExecuTorch lowering
def test_executorch_static_int8_is_calibrated_and_close_to_fp32(
    runs: dict[str, Path], tmp_path: Path
) -> None:
    pytest.importorskip("executorch")
    run = runs["fp32"]
    rm = load_run_model(run)
    rows = validation_rows(rm, run)
    pte = tmp_path / "model.pte"
    write_pte(copy.deepcopy(rm.model), "static", rows.head(2), rows.inputs, pte)
    got = pte_runner(pte)(rows.inputs)
    with torch.no_grad():
        fp32 = rm.model(torch.from_numpy(rows.inputs["x"])).numpy()
    # int8 weights and activations (XNNPACK's PT2E quantizer, calibrated): a logit moves ~1e-2
    assert 1e-4 < float(np.abs(got - fp32).max()) < 0.5
    assert (got.argmax(axis=1) == fp32.argmax(axis=1)).mean() >= 0.97
    float_bytes = sum(p.numel() * 4 for p in rm.model.parameters())  # 19 KB; a float .pte holds more
    assert pte.stat().st_size < 0.6 * float_bytes  # int8 weights, plus the program's ~5 KB


def test_the_report_says_what_qat_recovers_and_draws_the_plot(
    runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Execute: the QAT run's int8 (ONNX Runtime) beside the float run's
    folder = tmp_path / "m"
    args = ["edge", "export", str(runs["qat"]), "--target", "onnx", "--calls", "5", "--out", str(folder)]
    code, stdout, _ = vatra_in_process(capsys, *args, "--compare", str(runs["fp32"]))
    assert code == 0, stdout
    report = json.loads((folder / REPORT).read_text())
    # Assert: each variant's stage, and torchao's recovered = (QAT − PTQ) / (fp32 − PTQ)
    fp32_name = f"{runs['fp32'].name}/fp32"
    ptq_name = f"{runs['fp32'].name}/int8-dynamic"
    stages = {v["variant"]: v["stage"] for v in report["variants"]}
    assert stages == {"fp32": "QAT (float)", "int8-dynamic": "QAT", fp32_name: "fp32", ptq_name: "PTQ"}
    by = {v["variant"]: v for v in report["variants"]}
    [entry] = report["recovered"]
    assert entry["variant"] == "int8-dynamic" and entry["ptq_variant"] == ptq_name
    qat, ptq, fp32 = (by[n]["accuracy"] for n in ("int8-dynamic", ptq_name, fp32_name))
    if fp32 != ptq:
        assert entry["recovered_pct"] == pytest.approx(100 * (qat - ptq) / (fp32 - ptq))
    else:
        assert entry["recovered_pct"] is None and "PTQ lost nothing" in entry["why_none"]
    png = folder / PLOT
    assert report["plot"] == PLOT and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert PLOT in json.loads((folder / MANIFEST).read_text())["files"]
    assert "recovers" in stdout and "PTQ accuracy drop" in stdout and str(folder / PLOT) in stdout
    vatra.load(folder)  # the plot is checksummed with the rest


def test_the_export_does_not_need_matplotlib(
    runs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    folder, report = edge_export(runs["fp32"], tmp_path / "m", "onnx", calls=3)
    assert report["plot"] is None and not (folder / PLOT).exists() and (folder / REPORT).is_file()


def test_recovered_is_torchaos_measure() -> None:
    def row(name: str, stage: str, quant: str, acc: float) -> dict[str, Any]:
        return {"variant": name, "stage": stage, "quant": quant, "accuracy": acc}

    variants = [
        row("b/fp32", "fp32", "none", 0.90),
        row("b/int4w", "PTQ", "int4w", 0.80),
        row("int4w", "QAT", "int4w", 0.85),
        row("pruned+int4w", "pruned + QAT", "int4w", 0.83),
    ]
    got = recovered(variants)
    assert [e["recovered_pct"] for e in got] == pytest.approx([50.0, 30.0])
    rmse = [{"variant": v["variant"], "stage": v["stage"], "quant": v["quant"]} for v in variants]
    for v, value in zip(rmse, (1.0, 2.0, 1.5, 1.9), strict=True):
        v["rmse"] = value  # lower is better: the same formula
    assert [e["recovered_pct"] for e in recovered(rmse)] == pytest.approx([50.0, 10.0])
    alone = recovered([row("int4w", "QAT", "int4w", 0.85)])
    assert alone[0]["recovered_pct"] is None and "--compare" in alone[0]["why_none"]


class _TinyCnn(torch.nn.Module):
    """A conv net on 8×8 images (64 columns): its lowered program takes at most 15 rows at a time."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.head = torch.nn.Conv2d(1, 6, 3, padding=1), torch.nn.Linear(6 * 8 * 8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.conv(x.view(-1, 1, 8, 8))).flatten(1))


@pytest.mark.slow(10)  # one lowering of a conv net
def test_a_conv_program_that_refuses_a_large_batch_scores_it_in_chunks(tmp_path: Path) -> None:
    # Prepare: a lowered conv net, and more rows than its program accepts at once
    pytest.importorskip("executorch")
    torch.manual_seed(0)
    model = _TinyCnn().eval()
    x = np.random.default_rng(0).random((64, 64), dtype=np.float32)
    write_pte(model, "none", {"x": x[:2]}, {"x": x}, tmp_path / "cnn.pte")
    # Execute: all 64 rows at once, twice (the second call starts at the size that worked)
    run = pte_runner(tmp_path / "cnn.pte")
    first, second = run({"x": x}), run({"x": x})
    # Assert: every row scored, in order, as PyTorch scores it
    with torch.no_grad():
        expected = model(torch.from_numpy(x)).numpy()
    assert first.shape == (64, 10)
    np.testing.assert_allclose(first, expected, atol=1e-4)
    np.testing.assert_array_equal(first, second)
