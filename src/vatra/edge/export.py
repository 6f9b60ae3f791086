"""``vatra edge export``: a run's model made small for a CPU or a phone, as a model folder with a report.

Per variant (fp32, then the quantization and pruning asked for; with ``max_mb`` / ``max_ms`` every
quantization mode the target has) a whole model folder is written (serve's format: ``vatra.load``
reads it) and measured as loaded: size, latency, validation score, difference from fp32. The
chosen variant's folder is renamed into place with ``edge-report.json`` (every variant's row);
the others are removed. Targets: ``onnx`` (ONNX Runtime quantization), ``pt2`` (torch.export of a
torchao-quantized model), ``torchscript`` (fp32 or pruned only: TorchScript cannot trace torchao's
int8 tensors) and ``executorch`` (a ``.pte`` program lowered to XNNPACK: :mod:`vatra.edge.lower`;
needs the ``executorch`` package). ``compare`` runs get the same variants measured beside, each
row naming its stage (fp32 → PTQ → QAT → pruned + QAT), and the report what QAT recovers of the
PTQ drop (:mod:`vatra.edge.report`), with a plot.
"""

from __future__ import annotations

import copy
import json
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from vatra.compress.prune import PRUNE_METHODS, count_parameters, prune_model
from vatra.edge.lower import check_executorch, write_pte
from vatra.edge.measure import Rows, measure, validation_rows
from vatra.edge.quant import QUANT_MODES, ort_quantize, torchao_quantize
from vatra.edge.report import PLOT, recovered, stage, write_plot
from vatra.errors import ConfigError
from vatra.serve.export import write_weights
from vatra.serve.folder import FORMAT, FORMAT_VERSION, MANIFEST, PREPROCESS, WEIGHTS, file_sha256, load_folder
from vatra.serve.lineage import lineage
from vatra.serve.predict import Runner, torch_runner
from vatra.serve.signature import make_signature
from vatra.serve.weights import RunModel, load_run_model, spec_to_dict

TARGETS = ("onnx", "pt2", "torchscript", "executorch")
REPORT = "edge-report.json"


@dataclass(frozen=True)
class Recipe:
    """One variant: how it is quantized and pruned."""

    quant: str = "none"
    prune: str = "none"
    sparsity: float = 0.0

    @property
    def name(self) -> str:
        parts = [f"{self.prune}-{round(self.sparsity * 100)}%"] if self.prune != "none" else []
        if self.quant != "none":
            parts.append("int4w" if self.quant == "int4w" else f"int8-{self.quant}")
        return "+".join(parts) or "fp32"


def _check_args(target: str, recipe: Recipe) -> None:
    if target not in TARGETS:
        raise ConfigError(f"vatra edge export --target {target!r}: choose one of {', '.join(TARGETS)}")
    if recipe.quant not in QUANT_MODES:
        raise ConfigError(
            f"vatra edge export --quant {recipe.quant!r}: choose one of {', '.join(QUANT_MODES)}"
        )
    if recipe.prune not in PRUNE_METHODS:
        raise ConfigError(
            f"vatra edge export --prune {recipe.prune!r}: choose one of {', '.join(PRUNE_METHODS)}"
        )
    if target == "torchscript" and recipe.quant != "none":
        raise ConfigError(
            "vatra edge export --target torchscript: TorchScript cannot trace torchao's int8 tensors; "
            "quantize with --target pt2 (torch.export) or --target onnx"
        )
    if target == "executorch":
        check_executorch()
    if target == "onnx" and recipe.quant == "int4w":
        raise ConfigError(
            "vatra edge export --target onnx --quant int4w: ONNX Runtime's quantizers give int8 here; "
            "int4 weights export with --target pt2 (torchao) or --target executorch (XNNPACK)"
        )


def target_quants(target: str) -> list[str]:
    """The quantization modes ``target`` has (what --max-mb / --max-ms try)."""
    if target == "torchscript":
        return ["none"]
    return [q for q in QUANT_MODES if target != "onnx" or q != "int4w"]


def _recipes(target: str, wanted: Recipe, search: bool) -> list[Recipe]:
    """fp32 first, then the asked-for variant, or (``search``) every quantization mode the target has,
    unpruned and pruned as asked."""
    quants = [wanted.quant] if not search else target_quants(target)
    prunes = [Recipe()] if wanted.prune == "none" else [Recipe(), replace(wanted, quant="none")]
    out = [Recipe()]
    for p in prunes:
        for q in quants:
            r = replace(p, quant=q)
            if r not in out:
                out.append(r)
    return out


def write_variant(rm: RunModel, run_dir: Path, recipe: Recipe, target: str, rows: Rows, dest: Path) -> Path:
    """A model folder ``dest`` (created) holding ``rm``'s model pruned and quantized as ``recipe`` says."""
    dest.mkdir(parents=True)
    model = prune_model(copy.deepcopy(rm.model), recipe.prune, recipe.sparsity).eval()
    total, nonzero = count_parameters(model)
    example = rows.head(2)
    weights = WEIGHTS[target]
    if target == "onnx":
        fp32 = dest.parent / f"{dest.name}-fp32.onnx"
        write_weights(replace(rm, model=model), "onnx", fp32, example)
        if recipe.quant == "none":
            fp32.replace(dest / weights)
        else:
            ort_quantize(fp32, dest / weights, recipe.quant, rows.inputs)
            fp32.unlink()
    elif target == "executorch":
        write_pte(model, recipe.quant, example, rows.inputs, dest / weights)
    else:
        if recipe.quant != "none":
            model = torchao_quantize(model, recipe.quant, rows.inputs)
        write_weights(replace(rm, model=model), target, dest / weights, example)
    files = [weights]
    if rm.preprocess is not None:
        shutil.copyfile(run_dir / "data" / PREPROCESS, dest / PREPROCESS)
        files.append(PREPROCESS)
    manifest: dict[str, Any] = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "weights": {"format": target, "file": weights},
        "spec": spec_to_dict(rm.spec),
        "signature": make_signature(rm.preprocess, rm.spec, rm.cfg.data.name, rm.standardize),
        "lineage": lineage(run_dir, rm.cfg, rm.checkpoint),
        "check": None,
        "edge": {"variant": recipe.name, "target": target, "parameters": total, "nonzero_parameters": nonzero}
        | {"quant": recipe.quant, "prune": recipe.prune, "sparsity": recipe.sparsity},
        "files": {name: file_sha256(dest / name) for name in files},
    }
    (dest / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return dest


def variant_runner(folder: Path) -> Runner:
    """The folder's model as ``vatra.load`` runs it; an ONNX model on one ONNX Runtime thread."""
    if (folder / WEIGHTS["onnx"]).is_file():
        from vatra.serve.folder import onnx_runner

        return onnx_runner(folder / WEIGHTS["onnx"], threads=1)
    return load_folder(folder).runner


def edge_export(
    run_dir: str | Path,
    out_dir: str | Path,
    target: str = "onnx",
    recipe: Recipe = Recipe(quant="dynamic"),
    *,
    max_mb: float | None = None,
    max_ms: float | None = None,
    batch: int = 32,
    calls: int = 200,
    version: str | None = None,
    compare: Sequence[str | Path] = (),
) -> tuple[Path, dict[str, Any]]:
    """Write the variant of ``run_dir``'s model that ``recipe`` (or, with ``max_mb`` / ``max_ms``,
    the smallest / fastest variant meeting them) gives, as the model folder ``out_dir``; returns the
    folder and the report (every variant measured). The ``compare`` runs (trained on the same data:
    a float run beside a QAT run, a pruned one...) get the same variants measured beside, so the
    report says what QAT recovers of the PTQ drop and the limits choose among all of them."""
    _check_args(target, recipe)
    run_dir, out = Path(run_dir), Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"vatra edge export --out {out}: exists and is not empty; name a new folder")
    if batch < 1 or calls < 1:
        raise ConfigError("vatra edge export: --batch and --calls must be at least 1")
    search = max_mb is not None or max_ms is not None
    runs = [
        (run_dir, load_run_model(run_dir, version)),
        *((Path(c), load_run_model(Path(c))) for c in compare),
    ]
    task = runs[0][1].cfg.train.task
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        variants: list[dict[str, Any]] = []
        n_rows = 0
        for i, (rdir, rm) in enumerate(runs):
            rows = validation_rows(rm, rdir)
            reference = torch_runner(rm.model)(rows.inputs)
            trained = _trained(rm)
            prefix = "" if i == 0 else f"{rdir.name}/"
            for r in _recipes(target, recipe, search):
                folder = write_variant(rm, rdir, r, target, rows, work / f"{i}-{r.name.replace('%', 'pct')}")
                size = (folder / WEIGHTS[target]).stat().st_size
                row = measure(
                    variant_runner(folder), rows, task, size, batch=batch, calls=calls, reference=reference
                )
                edge = json.loads((folder / MANIFEST).read_text())["edge"]
                where = {"run": str(rdir), "folder": folder.name, "trained": trained}
                variants.append(
                    {**edge, "variant": prefix + r.name, "stage": stage(trained, r.quant, r.prune)}
                )
                variants[-1] |= where | row
            n_rows = n_rows or len(rows.targets)
        _relative_to_fp32(variants)
        qat_recovered = recovered(variants)
        chosen = _choose(variants, recipe.name, max_mb, max_ms)
        report = {"target": target, "batch": batch, "calls": calls, "rows": n_rows}
        report["trained"] = _trained(
            runs[0][1]
        )  # how the run trained: a QAT run's int8 variants are its QAT model
        report |= {
            "task": task,
            "chosen": chosen["variant"],
            "max_mb": max_mb,
            "max_ms": max_ms,
            "recovered": qat_recovered,
            "variants": variants,
        }
        folder = work / chosen["folder"]
        _finish(folder, report, chosen)
        if out.exists():
            out.rmdir()  # empty, checked above
        folder.replace(out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out, report


def _trained(rm: RunModel) -> dict[str, Any]:
    edge = rm.cfg.edge
    return {"qat": edge.qat, "prune": edge.prune, "sparsity": edge.sparsity * (edge.prune != "none")}


def _relative_to_fp32(variants: list[dict[str, Any]]) -> None:
    base = variants[0]
    for v in variants:
        v["size_vs_fp32"] = v["size_bytes"] / base["size_bytes"]
        v["speedup_batch1"] = base["latency_ms_batch1"]["p50"] / v["latency_ms_batch1"]["p50"]


def _choose(
    variants: list[dict[str, Any]], wanted: str, max_mb: float | None, max_ms: float | None
) -> dict[str, Any]:
    if max_mb is None and max_ms is None:
        return next(v for v in variants if v["variant"] == wanted)
    fits = [
        v
        for v in variants
        if (max_mb is None or v["size_mb"] <= max_mb)
        and (max_ms is None or v["latency_ms_batch1"]["p50"] <= max_ms)
    ]
    if not fits:
        seen = "; ".join(
            f"{v['variant']} {v['size_mb']:.3g} MB {v['latency_ms_batch1']['p50']:.3g} ms" for v in variants
        )
        raise ConfigError(
            f"vatra edge export: no variant meets --max-mb {max_mb} --max-ms {max_ms} (p50 at batch 1): "
            f"{seen}; relax a limit or add --prune"
        )
    if max_mb is not None:  # the smallest; the faster of equal sizes
        return min(fits, key=lambda v: (v["size_bytes"], v["latency_ms_batch1"]["p50"]))
    return min(fits, key=lambda v: (v["latency_ms_batch1"]["p50"], v["size_bytes"]))


def _finish(folder: Path, report: dict[str, Any], chosen: dict[str, Any]) -> None:
    """The report and its plot beside the chosen model (listed with their checksums) and its check
    in the manifest."""
    report["plot"] = PLOT if write_plot(report, folder / PLOT) else None
    (folder / REPORT).write_text(json.dumps(report, indent=1))
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["files"][REPORT] = file_sha256(folder / REPORT)
    if report["plot"]:
        manifest["files"][PLOT] = file_sha256(folder / PLOT)
    diff = chosen.get("max_abs_diff_vs_fp32", float(np.nan))
    manifest["check"] = {"rows": report["rows"], "max_abs_diff": diff, "against": "the fp32 PyTorch model"}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1))
