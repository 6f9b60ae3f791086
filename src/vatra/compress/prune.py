"""Pruning: magnitude (unstructured, zeros in place) and structured (hidden neurons really removed).

``magnitude``: torch's L1 magnitude criterion (``prune.L1Unstructured``) over every Linear weight
at once, the zeros written into the weights: the tensors keep their shapes (a dense file
is no smaller; a sparse kernel or a compressor gains from them). Training holds them at zero with
the masks (:class:`vatra.compress.plugin.EdgeTraining`). ``structured``: for an MLP
(``trunk`` of Linear + elementwise layers, then a ``head``), the hidden neurons with the smallest
L2 norm of their incoming weights are cut: the Linear producing them loses rows, the next one
columns, so the model has fewer parameters and does fewer multiply-adds.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn
from torch.nn.utils import prune

from vatra.errors import ConfigError

PRUNE_METHODS = ("none", "magnitude", "structured")


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(all parameters, the non-zero ones)."""
    total = sum(p.numel() for p in model.parameters())
    nonzero = sum(int(torch.count_nonzero(p)) for p in model.parameters())
    return total, nonzero


def prune_model(model: nn.Module, method: str, sparsity: float) -> nn.Module:
    """``model`` pruned in place to ``sparsity`` (the fraction of Linear weights or hidden neurons cut)."""
    if not 0.0 <= sparsity < 1.0:
        raise ConfigError(f"sparsity {sparsity}: must be at least 0 and below 1 (0.5 cuts half)")
    if method == "magnitude":
        magnitude_prune(model, sparsity)
    elif method == "structured":
        structured_prune(model, sparsity)
    elif method != "none":
        raise ConfigError(f"prune {method!r}: choose one of {', '.join(PRUNE_METHODS)}")
    return model


def magnitude_prune(model: nn.Module, sparsity: float) -> None:
    magnitude_masks(model, sparsity)


def magnitude_masks(model: nn.Module, sparsity: float) -> dict[nn.Parameter, torch.Tensor]:
    """Zero the ``sparsity`` share of all Linear weights smallest in absolute value (one threshold
    over every layer: torch's ``L1Unstructured`` on their concatenation), in place; returns each
    weight's mask (1 kept, 0 cut) to hold the zeros with. The weights stay the same Parameter
    objects in the same order (``prune.remove`` re-registers each weight after its bias, which
    reorders ``parameters()`` for anything that pairs state with it by position)."""
    weights = [cast(nn.Parameter, m.weight) for m in model.modules() if isinstance(m, nn.Linear)]
    if not weights or sparsity == 0.0:
        return {}
    scores = torch.cat([w.detach().abs().flatten() for w in weights])  # (all Linear weights,)
    flat = prune.L1Unstructured(amount=sparsity).compute_mask(scores, default_mask=torch.ones_like(scores))
    masks: dict[nn.Parameter, torch.Tensor] = {}
    offset = 0
    with torch.no_grad():
        for w in weights:
            mask = flat[offset : offset + w.numel()].view_as(w)
            offset += w.numel()
            w.mul_(mask)
            masks[w] = mask
    return masks


def _hidden_chain(model: nn.Module) -> list[tuple[nn.Linear, list[nn.Linear]]]:
    """Each hidden Linear with the Linear layers that read its outputs (the next one, or the heads)."""
    trunk, head = getattr(model, "trunk", None), getattr(model, "head", None)
    if not isinstance(trunk, nn.Sequential) or head is None:
        raise ConfigError(
            f"structured pruning removes hidden neurons of the mlp model (trunk + head); "
            f"{type(model).__name__} is not one: use --prune magnitude"
        )
    for layer in trunk:
        if not isinstance(layer, nn.Linear | nn.ReLU | nn.GELU | nn.Tanh | nn.Dropout):
            raise ConfigError(
                f"structured pruning: the mlp trunk holds a {type(layer).__name__}, which it cannot "
                "shrink; use --prune magnitude"
            )
    linears = [m for m in trunk if isinstance(m, nn.Linear)]
    heads = [
        h for h in (head.values() if isinstance(head, nn.ModuleDict) else [head]) if isinstance(h, nn.Linear)
    ]
    if not heads or len(heads) != (len(head) if isinstance(head, nn.ModuleDict) else 1):
        raise ConfigError("structured pruning: the mlp's head is not Linear; use --prune magnitude")
    return [(lin, [linears[i + 1]] if i + 1 < len(linears) else heads) for i, lin in enumerate(linears)]


def structured_prune(model: nn.Module, sparsity: float) -> None:
    """Cut ``sparsity`` of each hidden layer's neurons (one at least kept), smallest incoming norm first."""
    for producer, consumers in _hidden_chain(model):
        width = producer.out_features
        keep_n = max(1, round(width * (1.0 - sparsity)))
        if keep_n == width:
            continue
        score = producer.weight.detach().norm(dim=1)  # (out,): each neuron's incoming weight norm
        keep = torch.sort(torch.topk(score, keep_n).indices).values
        _shrink(producer, rows=keep)
        for consumer in consumers:
            _shrink(consumer, cols=keep)


def _shrink(layer: nn.Linear, rows: torch.Tensor | None = None, cols: torch.Tensor | None = None) -> None:
    """``layer`` keeps only the output ``rows`` / input ``cols`` given: new, smaller parameters."""
    with torch.no_grad():
        weight = layer.weight
        if rows is not None:
            weight = weight[rows]
            if layer.bias is not None:
                layer.bias = nn.Parameter(layer.bias[rows].clone())
            layer.out_features = len(rows)
        if cols is not None:
            weight = weight[:, cols]
            layer.in_features = len(cols)
        layer.weight = nn.Parameter(weight.clone())
