"""Post-training int8 quantization, a backend per target: torchao for PyTorch (pt2), ONNX Runtime for ONNX.

``dynamic``: weights int8 ahead of time, activations quantized per call from their own range.
``int4w``: int4 weights in groups of 32 inputs, int8 activations per call (torchao's
``Int8DynamicActivationIntxWeightConfig``, what ``edge.qat = "int4w"`` trains for; torchao only).
``static``: activations too get a fixed scale, measured here on calibration rows (the run's
validation rows): torchao's ``Int8StaticActivationInt8WeightConfig`` with one per-tensor scale per
Linear input (the largest absolute value seen / 127), ONNX Runtime's ``quantize_static`` with a
MinMax calibration over the same rows (QDQ format, per-channel weights).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from torch import nn

from vatra._extras import require
from vatra.compress.qat4 import convert_int4w

QUANT_MODES = ("none", "dynamic", "static", "int4w")
CALIBRATION_BATCH = 64  # rows per calibration call


@contextmanager
def _quiet() -> Iterator[None]:
    """torchao warns at import about CUDA kernels this CPU build does not have: harmless here."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def torchao_quantize(model: nn.Module, mode: str, calibration: dict[str, np.ndarray] | None) -> nn.Module:
    """``model`` (changed in place and returned) with its Linear layers int8 by torchao: ``dynamic``
    or ``static`` (activation scales from ``calibration`` rows). Embeddings stay float."""
    with _quiet():
        require("torchao", "edge", "int8 quantization of a PyTorch model")
        from torchao.quantization import (
            Int8DynamicActivationInt8WeightConfig,
            Int8StaticActivationInt8WeightConfig,
            quantize_,
        )
        from torchao.quantization.granularity import PerRow, PerTensor

        if mode == "dynamic":
            quantize_(model, Int8DynamicActivationInt8WeightConfig())
            return model
        if mode == "int4w":  # what edge.qat = "int4w" converts to; a float run: post-training int4w
            return convert_int4w(model)
        if calibration is None:
            raise ValueError("static quantization needs calibration rows")
        for name, amax in linear_input_ranges(model, calibration).items():
            # scale shape (1, 1): torchao wants as many dims as the (B, F) activation it scales
            scale = torch.tensor([[max(amax, 1e-8) / 127.0]])
            # one activation scale per layer (static), weights per output row as in dynamic mode
            granularity = [PerTensor(), PerRow()]
            config = Int8StaticActivationInt8WeightConfig(act_quant_scale=scale, granularity=granularity)
            quantize_(model, config, filter_fn=lambda _m, fqn, name=name: fqn == name)
    return model


def linear_input_ranges(model: nn.Module, calibration: dict[str, np.ndarray]) -> dict[str, float]:
    """The largest absolute input each Linear layer sees over the calibration rows (its fqn -> amax)."""
    from vatra.engine.objective import call_model

    amax: dict[str, float] = {}

    def observe(name: str) -> object:
        def hook(_module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            amax[name] = max(amax.get(name, 0.0), float(args[0].detach().abs().max()))

        return hook

    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    handles = [m.register_forward_pre_hook(observe(n)) for n, m in linears]  # type: ignore[arg-type]
    try:
        rows = len(next(iter(calibration.values())))
        with torch.no_grad():
            for start in range(0, rows, CALIBRATION_BATCH):
                batch = {
                    k: torch.from_numpy(v[start : start + CALIBRATION_BATCH]) for k, v in calibration.items()
                }
                call_model(model, batch if "ids" in batch else batch["x"])
    finally:
        for h in handles:
            h.remove()
    return amax


def ort_quantize(fp32: Path, out: Path, mode: str, calibration: dict[str, np.ndarray] | None) -> None:
    """The ONNX model ``fp32`` quantized to int8 by ONNX Runtime into ``out``: ``dynamic``
    (``quantize_dynamic``, int8 weights) or ``static`` (``quantize_static``, QDQ, calibrated)."""
    require("onnxruntime", "onnx", "int8 quantization of an ONNX model")
    from onnxruntime.quantization import (
        CalibrationDataReader,
        QuantFormat,
        QuantType,
        quantize_dynamic,
        quantize_static,
    )

    if mode == "dynamic":
        with _ort_quiet():
            quantize_dynamic(str(fp32), str(out), weight_type=QuantType.QInt8)
        return
    if calibration is None:
        raise ValueError("static quantization needs calibration rows")

    class Rows(CalibrationDataReader):
        """The calibration rows in batches, as ONNX Runtime's MinMax calibrator reads them."""

        def __init__(self, rows: dict[str, np.ndarray]) -> None:
            n = len(next(iter(rows.values())))
            self.batches = iter(
                [
                    {k: v[s : s + CALIBRATION_BATCH] for k, v in rows.items()}
                    for s in range(0, n, CALIBRATION_BATCH)
                ]
            )

        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(self.batches, None)

    with _ort_quiet():
        quantize_static(
            str(fp32),
            str(out),
            Rows(calibration),
            quant_format=QuantFormat.QDQ,
            per_channel=True,
            activation_type=QuantType.QInt8,
            weight_type=QuantType.QInt8,
            op_types_to_quantize=["MatMul", "Gemm"],
        )


@contextmanager
def _ort_quiet() -> Iterator[None]:
    """ONNX Runtime's quantizer logs "consider pre-processing" on the root logger for every model: its
    shape inference pass matters for convolutions and dynamic shapes, not for these Linear stacks."""
    logging.disable(logging.WARNING)
    try:
        yield
    finally:
        logging.disable(logging.NOTSET)
