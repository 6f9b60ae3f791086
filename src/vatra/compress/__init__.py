"""Model compression during and after training: int8 fake quantization (QAT) and pruning.

The training side of edge models: :class:`EdgeTraining` (the ``[edge]`` plugin) fake-quantizes the
Linear layers from ``edge.qat_start_step`` and prunes on ``edge.prune_schedule``; the pruning
functions also serve ``vatra edge export`` (:mod:`vatra.edge`), which converts and measures.
"""

from __future__ import annotations

from vatra.compress.plugin import EdgeTraining, scheduled_sparsity
from vatra.compress.prune import PRUNE_METHODS, count_parameters, magnitude_masks, prune_model
from vatra.compress.qat import fake_quant_int8, is_prepared, prepare_qat, remove_qat

__all__ = [
    "PRUNE_METHODS",
    "EdgeTraining",
    "count_parameters",
    "fake_quant_int8",
    "is_prepared",
    "magnitude_masks",
    "prepare_qat",
    "prune_model",
    "remove_qat",
    "scheduled_sparsity",
]
