"""vatra edge export: int8 post-training quantization (torchao, ONNX Runtime), pruning, variant choice."""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pyarrow.parquet as pq
import pytest
import torch
from tests.conftest import vatra_in_process
from tests.test_serve_predict import _config, _table, _val
from torch import nn

import vatra
from vatra.edge import REPORT, Recipe, count_parameters, edge_export, prune_model, torchao_quantize
from vatra.edge.measure import validation_rows
from vatra.errors import ConfigError
from vatra.serve.folder import MANIFEST
from vatra.serve.weights import load_run_model


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """A finished table run (two hidden layers, so structured pruning has a chain to cut)."""
    folder = tmp_path_factory.mktemp("edge")
    table = _table()
    pq.write_table(table, folder / "rows.parquet")
    cfg = _config(folder / "rows.parquet", folder / "runs")
    cfg["model"]["hidden"] = [64, 32]
    return vatra.fit(cfg).run_dir, _val(table)


def _fake_quant(t: torch.Tensor, amax: torch.Tensor, half_range: float = 127.5) -> torch.Tensor:
    """Symmetric int8 quantize-dequantize, as torchao's ``quantize_affine`` defines it: scale
    ``amax / half_range`` (torchao's own for a range it measures: 255 levels over [-amax, amax]),
    ``round(t * (1 / scale))`` (multiplying by the reciprocal decides the ties at ±amax)."""
    scale = amax.clamp_min(1e-8) / half_range
    return torch.round(t * (1.0 / scale)).clamp(-128, 127) * scale


class _FakeQuantLinear(nn.Module):
    """The float emulation of an int8 Linear: weights per output row, activations per row
    (``dynamic``) or per tensor with a calibrated range (``static``)."""

    def __init__(self, linear: nn.Linear, act_amax: float | None) -> None:
        super().__init__()
        w = linear.weight.detach()
        self.weight = _fake_quant(w, w.abs().amax(dim=1, keepdim=True))
        self.bias = linear.bias.detach() if linear.bias is not None else None
        self.act_amax = act_amax

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.act_amax is None:
            x = _fake_quant(x, x.abs().amax(dim=-1, keepdim=True))
        else:  # the calibrated scale vatra hands torchao: amax / 127
            x = _fake_quant(x, torch.tensor(self.act_amax), 127.0)
        return nn.functional.linear(x, self.weight, self.bias)


def _emulated(model: nn.Module, ranges: dict[str, float] | None) -> nn.Module:
    fq = copy.deepcopy(model)
    for name, module in list(fq.named_modules()):
        if isinstance(module, nn.Linear):
            parent, _, leaf = name.rpartition(".")
            act = None if ranges is None else ranges[name]
            setattr(fq.get_submodule(parent) if parent else fq, leaf, _FakeQuantLinear(module, act))
    return fq


@pytest.mark.parametrize("mode", ["dynamic", "static"])
def test_torchao_int8_matches_its_fake_quantized_emulation(trained: Any, mode: str) -> None:
    # Prepare: the run's model, its validation rows, the int8 model and a float emulation of it
    run, _ = trained
    rm = load_run_model(run)
    rows = validation_rows(rm, run)
    x = torch.from_numpy(rows.inputs["x"])
    from vatra.edge.quant import linear_input_ranges

    ranges = linear_input_ranges(rm.model, rows.inputs) if mode == "static" else None
    emulated = _emulated(rm.model, ranges)
    # Execute
    int8 = torchao_quantize(copy.deepcopy(rm.model), mode, rows.inputs)
    # Assert: the Linear weights are int8 tensors now; each int8 layer, fed the emulation's input,
    # gives the emulation's output up to float rounding of the accumulation (end to end, a 1e-7
    # difference may flip one activation's rounding in the next layer, hence layer by layer)
    assert "Int8" in type(int8.trunk[0].weight).__name__
    h = x
    for got_layer, want_layer in zip([*int8.trunk, int8.head], [*emulated.trunk, emulated.head], strict=True):
        with torch.no_grad():
            got, want = got_layer(h), want_layer(h)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        h = want
    with torch.no_grad():  # and the int8 error they share is real: the emulation is not fp32
        assert float((rm.model(x) - h).abs().max()) > 1e-3


@pytest.mark.parametrize("quant", ["dynamic", "static"])
def test_onnx_int8_exports_load_and_agree_with_fp32_within_quantization_error(
    trained: Any, tmp_path: Path, quant: str
) -> None:
    run, val = trained
    target = "onnx"
    want = vatra.load(run).predict(val)
    folder, report = edge_export(run, tmp_path / "m", target, Recipe(quant=quant), calls=20)
    got = vatra.load(folder).predict(val)
    # int8 weights and activations move a probability by about a percent here; 0.05 bounds it
    np.testing.assert_allclose(got["proba_yes"], want["proba_yes"], rtol=0, atol=0.05)
    assert (got["prediction"] == want["prediction"]).mean() >= 0.95
    names = [v["variant"] for v in report["variants"]]
    assert names == ["fp32", f"int8-{quant}"] and report["chosen"] == f"int8-{quant}"
    manifest = json.loads((folder / MANIFEST).read_text())
    assert manifest["edge"]["quant"] == quant and REPORT in manifest["files"]
    assert 0 < manifest["check"]["max_abs_diff"] < 0.5
    for v in report["variants"]:
        assert v["latency_ms_batch1"]["p50"] > 0 and 0.0 <= v["accuracy"] <= 1.0
    ops = {n.op_type for n in onnx.load(str(folder / "model.onnx")).graph.node}  # really int8
    assert ops & {"MatMulInteger", "DynamicQuantizeLinear", "QuantizeLinear"}


@pytest.mark.slow(10)  # torch.export of the torchao model and its load: ~8 s here
def test_pt2_export_is_the_in_memory_torchao_model(trained: Any, tmp_path: Path) -> None:
    run, val = trained
    rm = load_run_model(run)
    rows = validation_rows(rm, run)
    int8 = torchao_quantize(copy.deepcopy(rm.model), "static", rows.inputs)
    folder, report = edge_export(run, tmp_path / "m", "pt2", Recipe(quant="static"), calls=5)
    predictor = vatra.load(folder)
    with torch.no_grad():
        want = int8(torch.from_numpy(rows.inputs["x"])).numpy()
    np.testing.assert_allclose(
        predictor.runner(rows.inputs), want, rtol=0, atol=1e-5
    )  # export keeps numerics
    fp32 = vatra.load(run).predict(val)
    np.testing.assert_allclose(predictor.predict(val)["proba_yes"], fp32["proba_yes"], rtol=0, atol=0.05)
    assert predictor.meta["weights"] == "pt2" and report["chosen"] == "int8-static"


def test_structured_pruning_removes_neurons_and_the_model_still_trains(trained: Any) -> None:
    # Prepare
    run, _ = trained
    rm = load_run_model(run)
    rows = validation_rows(rm, run)
    x, y = torch.from_numpy(rows.inputs["x"]), torch.from_numpy(rows.targets)
    before, _ = count_parameters(rm.model)
    # Execute
    pruned = prune_model(copy.deepcopy(rm.model), "structured", 0.75)
    # Assert: 64 -> 16 and 32 -> 8 hidden neurons, the Linear layers really smaller
    widths = [m.out_features for m in pruned.modules() if isinstance(m, nn.Linear)]
    assert widths == [16, 8, 2]
    after, nonzero = count_parameters(pruned)
    in_f = rm.model.trunk[0].in_features
    assert after == nonzero == (in_f * 16 + 16) + (16 * 8 + 8) + (8 * 2 + 2) < before / 3
    opt = torch.optim.Adam(pruned.parameters(), lr=0.01)
    losses = []
    for _ in range(30):
        loss = nn.functional.cross_entropy(pruned(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss))
    assert losses[-1] < 0.8 * losses[0]


def test_magnitude_pruning_zeroes_the_smallest_weights(trained: Any) -> None:
    run, _ = trained
    model = load_run_model(run).model
    weights = torch.cat([m.weight.detach().flatten() for m in model.modules() if isinstance(m, nn.Linear)])
    pruned = copy.deepcopy(model)
    before = [id(p) for p in pruned.parameters()]
    prune_model(pruned, "magnitude", 0.8)
    assert [id(p) for p in pruned.parameters()] == before  # same objects, same order
    kept = torch.cat([m.weight.detach().flatten() for m in pruned.modules() if isinstance(m, nn.Linear)])
    assert float((kept == 0).float().mean()) == pytest.approx(0.8, abs=1e-3)
    assert float(kept.abs()[kept != 0].min()) >= float(weights.abs().kthvalue(int(0.8 * len(weights))).values)


def test_limits_choose_the_smallest_variant_and_refuse_the_impossible(trained: Any, tmp_path: Path) -> None:
    run, _ = trained
    folder, report = edge_export(
        run, tmp_path / "m", "onnx", Recipe(prune="structured", sparsity=0.5), max_mb=10.0, calls=5
    )
    sizes = {v["variant"]: v["size_bytes"] for v in report["variants"]}
    assert len(sizes) == 6 and report["chosen"] == min(sizes, key=sizes.__getitem__)
    assert json.loads((folder / MANIFEST).read_text())["edge"]["variant"] == report["chosen"]
    _, fastest = edge_export(run, tmp_path / "fast", "onnx", max_ms=1e3, calls=5)
    p50 = {v["variant"]: v["latency_ms_batch1"]["p50"] for v in fastest["variants"]}
    assert set(p50) == {"fp32", "int8-dynamic", "int8-static"} and fastest["chosen"] == min(
        p50, key=p50.__getitem__
    )
    with pytest.raises(ConfigError, match="no variant meets --max-mb 1e-06"):
        edge_export(run, tmp_path / "none", "onnx", max_mb=1e-6, calls=2)
    assert not (tmp_path / "none").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_cli_edge_export_prints_the_report_and_refuses_bad_input(
    trained: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run, _ = trained
    out = tmp_path / "m"
    code, stdout, _ = vatra_in_process(
        capsys, "edge", "export", str(run), "--target", "onnx", "--calls", "5", "--out", str(out)
    )
    assert code == 0 and "int8-dynamic" in stdout and "fp32" in stdout and (out / REPORT).is_file()
    code, stdout, _ = vatra_in_process(
        capsys, "edge", "export", str(run), "--target", "torchscript", "--out", str(tmp_path / "ts")
    )
    assert code == 0 and "* fp32" in stdout  # no int8 for TorchScript: fp32 unless pruned
    bad = [
        (["--target", "tflite"], "choose one of onnx, pt2, torchscript, executorch"),
        (["--target", "torchscript", "--quant", "dynamic"], "TorchScript cannot trace"),
        (["--quant", "int3"], "choose one of none, dynamic, static"),
    ]
    if importlib.util.find_spec("executorch") is None:
        bad.append((["--target", "executorch"], "needs the package 'executorch'"))
    for args, words in bad:
        code, _, stderr = vatra_in_process(
            capsys, "edge", "export", str(run), *args, "--out", str(tmp_path / "x")
        )
        assert code == 2 and words in stderr and stderr.count("\n") == 1 and stderr.startswith("error:")
