"""Edge models: post-training int8 quantization, pruning, and export measured for a CPU or a phone.

``edge_export`` writes a run's model as a model folder (serve's format: ``vatra.load`` reads it)
quantized by the target's backend (torchao for ``pt2``, ONNX Runtime for ``onnx``) and pruned as
asked, with a report of every variant's size, latency and validation score.
"""

from __future__ import annotations

from vatra.compress.prune import count_parameters, prune_model
from vatra.edge.export import REPORT, TARGETS, Recipe, edge_export
from vatra.edge.quant import QUANT_MODES, ort_quantize, torchao_quantize

__all__ = [
    "QUANT_MODES",
    "REPORT",
    "TARGETS",
    "Recipe",
    "count_parameters",
    "edge_export",
    "ort_quantize",
    "prune_model",
    "torchao_quantize",
]
