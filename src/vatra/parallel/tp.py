"""Tensor parallelism on DTensor, applied from outside the model: the built-in gpt plan, users' plans."""

from __future__ import annotations

from collections.abc import Mapping
from fnmatch import fnmatchcase

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from vatra.errors import ConfigError
from vatra.models.gpt import GPT, Block, CausalSelfAttention

STYLES: dict[str, type[ParallelStyle]] = {
    "colwise": ColwiseParallel,
    "rowwise": RowwiseParallel,
    "sequence": SequenceParallel,
}

# Megatron's MLP and attention split: the first linear of each pair column-wise (its output features
# sharded, no communication), the second row-wise (its input features sharded, one all-reduce of
# the (B, T, C) output). Two all-reduces per block forward, two in backward.
GPT_BLOCK_PLAN: dict[str, str] = {
    "attn.qkv": "colwise",  # heads are split: qkv's rows are head-major (see models.gpt)
    "attn.proj": "rowwise",
    "mlp.0": "colwise",
    "mlp.2": "rowwise",
}


def gpt_plan(model: nn.Module) -> dict[str, str] | None:
    """The built-in plan for :class:`~vatra.models.gpt.GPT` and its pipeline stages (any module whose
    ``blocks`` are gpt blocks): every block's attention and MLP; None for other models.
    Embeddings, norms and the tied head stay replicated (small next to the blocks)."""
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.Module):
        return None
    named = list(blocks.named_children())
    if not named or not all(isinstance(block, Block) for _, block in named):
        return None
    return {f"blocks.{name}.{path}": style for name, _ in named for path, style in GPT_BLOCK_PLAN.items()}


def gpt_sequence_plan(model: nn.Module) -> dict[str, ParallelStyle]:
    """The gpt plan with sequence parallelism (Korthikanti et al. 2022): between the blocks' matmuls
    the activations stay split along the sequence, ``(B, T / tp, C)``, so LayerNorms and dropout
    work on a share and their activations take 1/tp of the memory. Each attention and MLP
    all-gathers its input's sequence and its row-wise output is reduce-scattered back (the same
    bytes as the plain plan's all-reduce); the first block splits the embeddings' output, the final
    norm gathers the last block's. ``T`` must be divisible by tp."""
    assert isinstance(model, GPT)
    seq, whole = (Shard(1),), (Replicate(),)
    plan: dict[str, ParallelStyle] = {}
    for i in range(len(model.blocks)):
        block = f"blocks.{i}"
        for norm in ("ln1", "ln2"):
            plan[f"{block}.{norm}"] = SequenceParallel(use_local_output=True)
        for inner, first, second in (("attn", "qkv", "proj"), ("mlp", "0", "2")):
            gather = PrepareModuleInput(input_layouts=seq, desired_input_layouts=whole, use_local_output=True)
            plan[f"{block}.{inner}"] = gather
            plan[f"{block}.{inner}.{first}"] = ColwiseParallel()
            plan[f"{block}.{inner}.{second}"] = RowwiseParallel(output_layouts=Shard(1))
    split = PrepareModuleInput(input_layouts=whole, desired_input_layouts=seq, use_local_output=True)
    plan["blocks.0"] = split
    plan["ln_f"] = PrepareModuleInput(input_layouts=seq, desired_input_layouts=whole, use_local_output=True)
    return plan


def resolve_plan(model: nn.Module, plan: Mapping[str, str]) -> dict[str, ParallelStyle]:
    """Module paths (``fnmatch`` globs: ``layers.*.fc1``) → styles, resolved against ``model``'s
    modules; a pattern that matches no module, or a style that is not known, is a ``ConfigError``."""
    names = [name for name, _ in model.named_modules() if name]
    resolved: dict[str, ParallelStyle] = {}
    for pattern, style in plan.items():
        if style not in STYLES:
            raise ConfigError(
                f"parallel.tp_plan[{pattern!r}] = {style!r}: unknown style; choose colwise, rowwise "
                "or sequence"
            )
        matched = [name for name in names if fnmatchcase(name, pattern)]
        if not matched:
            raise ConfigError(
                f"parallel.tp_plan: {pattern!r} matches no module of {type(model).__name__}; module paths "
                f"look like {', '.join(names[:4])}"
            )
        for name in matched:
            resolved[name] = STYLES[style]()
    return resolved


def apply_tp(
    model: nn.Module,
    mesh: DeviceMesh,
    plan: Mapping[str, str] | None = None,
    *,
    sequence_parallel: bool = False,
) -> nn.Module:
    """Split ``model``'s parameters over the 1-D ``tp`` mesh in place; returns it.

    ``plan``: module path → ``colwise`` | ``rowwise`` | ``sequence``; empty or None = the built-in
    plan (gpt only). A colwise linear's output stays sharded (local tensors of ``out / tp`` features)
    into the rowwise one that follows, so between them the module must work on its local share: for
    gpt each rank's attention computes ``n_head / tp`` heads, set here on every attention module.
    """
    tp = mesh.size()
    if sequence_parallel:
        if plan or not isinstance(model, GPT):
            raise ConfigError(
                "parallel.sequence_parallel splits the built-in gpt plan's norms; for a user's model put "
                "'sequence' styles in parallel.tp_plan instead"
            )
        parallelize_module(model, mesh, gpt_sequence_plan(model))
        _share_heads(model, tp)
        return model
    if not plan:
        plan = gpt_plan(model)
        if plan is None:
            raise ConfigError(
                f"parallel.tp = {tp}: there is no built-in tensor-parallel plan for "
                f"{type(model).__name__}; give one in parallel.tp_plan (module path → colwise | rowwise "
                "| sequence, see docs/parallel.md)"
            )
    parallelize_module(model, mesh, resolve_plan(model, plan))
    _share_heads(model, tp)
    return model


def _share_heads(model: nn.Module, tp: int) -> None:
    """Each rank's attention computes its ``n_head / tp`` heads (its columns of qkv)."""
    for module in model.modules():
        if isinstance(module, CausalSelfAttention):
            if module.n_head % tp:
                raise ConfigError(f"parallel.tp = {tp} does not divide the {module.n_head} attention heads")
            module.n_head //= tp
