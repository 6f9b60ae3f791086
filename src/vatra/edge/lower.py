"""ExecuTorch: a model lowered to the XNNPACK delegate as a ``.pte`` program, quantized as asked.

``torch.export`` (the batch dimension dynamic, up to ``MAX_ROWS``) → ``to_edge_transform_and_lower``
with the ``XnnpackPartitioner`` → ``to_executorch``. Quantization, the ways ExecuTorch's own
XNNPACK flows do it: ``dynamic`` and ``static`` through the PT2E quantizer
(``XNNPACKQuantizer``, symmetric int8, weights per output channel; activations per call or
calibrated on the run's validation rows), ``int4w`` through torchao's
``Int8DynamicActivationIntxWeightConfig`` (int4 weights in groups of 32, int8 activations per
call), which XNNPACK runs as one delegate. The runtime reads the file with
``executorch.runtime`` (:func:`vatra.serve.folder.pte_runner`).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from torch import nn

from vatra._extras import MissingExtra
from vatra.compress.qat4 import convert_int4w
from vatra.serve.export import _Positional

MAX_ROWS = 4096  # the largest batch the program accepts (XNNPACK plans for an upper bound)
CALIBRATION_ROWS = 256


def check_executorch() -> None:
    """One line naming the package when ExecuTorch is not installed."""
    import importlib.util

    if importlib.util.find_spec("executorch") is None:
        raise MissingExtra(
            "vatra edge export --target executorch needs the package 'executorch', which is not "
            "installed: pip install 'vatra[executorch]'"
        )


@contextmanager
def _quiet() -> Iterator[None]:
    """torchao and ExecuTorch warn at import about kernels and deprecations that do not apply here."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def write_pte(
    model: nn.Module,
    quant: str,
    example: dict[str, np.ndarray],
    calibration: dict[str, np.ndarray],
    path: Path,
) -> None:
    """``model`` (float; changed) quantized as ``quant`` and lowered to XNNPACK into ``path``."""
    check_executorch()
    with _quiet():
        from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
        from executorch.exir import to_edge_transform_and_lower

        wrapped = _Positional(model, "ids" in example).eval()
        args = tuple(torch.from_numpy(v) for v in example.values())
        rows = torch.export.Dim("rows", max=MAX_ROWS)
        shapes = tuple({0: rows} for _ in args)
        if quant == "int4w":
            convert_int4w(model)
        program = torch.export.export(wrapped, args, dynamic_shapes=shapes)
        if quant in ("dynamic", "static"):
            program = _pt2e_int8(program, quant, args, calibration, shapes)
        lowered = to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()])
        path.write_bytes(lowered.to_executorch().buffer)


def _pt2e_int8(
    program: torch.export.ExportedProgram,
    quant: str,
    args: tuple[torch.Tensor, ...],
    calibration: dict[str, np.ndarray],
    shapes: tuple[dict[int, torch.export.Dim], ...],
) -> torch.export.ExportedProgram:
    """The exported program int8 by XNNPACK's PT2E quantizer, calibrated on ``calibration`` (static)."""
    from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (
        XNNPACKQuantizer,
        get_symmetric_quantization_config,
    )
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    config = get_symmetric_quantization_config(is_per_channel=True, is_dynamic=quant == "dynamic")
    prepared = prepare_pt2e(program.module(), XNNPACKQuantizer().set_global(config))
    n = min(CALIBRATION_ROWS, len(next(iter(calibration.values()))))
    with torch.no_grad():
        prepared(*(torch.from_numpy(v[:n]) for v in calibration.values()))  # observers see the rows
    converted = convert_pt2e(prepared)
    return torch.export.export(converted, args, dynamic_shapes=shapes)
