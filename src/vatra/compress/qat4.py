"""int4-weight QAT by torchao: ``QATConfig(base, step="prepare")`` during training, ``"convert"`` after.

The base is torchao's ``Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4,
weight_granularity=PerGroup(32))`` (int8 activations quantized per call, int4 weights with one scale
per group of 32 inputs): the one QAT base that installs with torchao 0.18 on a CPU machine (its
int8 dynamic config is refused as a QAT base, ``Int4WeightOnlyConfig`` needs a package that is not
on PyPI for this platform). ``prepare`` swaps each eligible ``nn.Linear`` for torchao's
``FakeQuantizedLinear`` holding the *same* weight and bias Parameters, so DDP's buckets, the
optimizer's state and checkpoint keys are untouched; ``convert`` swaps them back and quantizes the
weights, which is what post-training int4w quantization of the trained float weights gives.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from vatra._extras import require

INT4_GROUP = 32  # inputs per int4 weight scale: a Linear whose in_features it does not divide stays float


def _eligible(module: nn.Module, _fqn: str = "") -> bool:
    return type(module) is nn.Linear and module.in_features % INT4_GROUP == 0


def int4w_config(step: str | None) -> Any:
    """torchao's int4-weight config: the QAT wrapper for ``step`` ("prepare" | "convert"), or the
    base config itself (``step=None``: post-training quantization)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torchao warns at import about CUDA kernels a CPU build lacks
        require("torchao", "edge", 'edge.qat = "int4w"')
        from torchao.quantization import Int8DynamicActivationIntxWeightConfig
        from torchao.quantization.granularity import PerGroup
        from torchao.quantization.qat import QATConfig

    int4 = torch.int4  # type: ignore[attr-defined]  # a sub-byte dtype the type stubs lack
    base = Int8DynamicActivationIntxWeightConfig(weight_dtype=int4, weight_granularity=PerGroup(INT4_GROUP))
    return base if step is None else QATConfig(base, step=step)


def prepare_int4w(model: nn.Module) -> int:
    """Fake-quantize every Linear of ``model`` whose inputs split in groups of 32 (in place); how many."""
    from torchao.quantization import quantize_

    n = sum(1 for m in model.modules() if _eligible(m))
    quantize_(model, int4w_config("prepare"), filter_fn=_eligible)
    return n


def is_int4w_prepared(model: nn.Module) -> bool:
    return any(type(m).__name__ == "FakeQuantizedLinear" for m in model.modules())


def convert_int4w(model: nn.Module) -> nn.Module:
    """``model`` (changed in place and returned) with int4 weights: a prepared model through QAT's
    convert step, a float one quantized as that step would (the same float weights give the same
    int4 model)."""
    from torchao.quantization import quantize_

    if is_int4w_prepared(model):
        quantize_(
            model, int4w_config("convert"), filter_fn=lambda m, _f: type(m).__name__ == "FakeQuantizedLinear"
        )
    else:
        quantize_(model, int4w_config(None), filter_fn=_eligible)
    return model
