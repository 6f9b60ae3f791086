"""Pruning: magnitude (unstructured, zeros in place) and structured (hidden neurons really removed).

``magnitude``: torch's L1 magnitude criterion (``prune.L1Unstructured``) over every Linear weight
at once, the zeros written into the weights: the tensors keep their shapes (a dense file
is no smaller; a sparse kernel or a compressor gains from them). Training holds them at zero with
the masks (:class:`vatra.compress.plugin.EdgeTraining`). ``structured``: for an MLP
(``trunk`` of Linear + elementwise layers, then a ``head``), the hidden neurons with the smallest
L2 norm of their incoming weights are cut: the Linear producing them loses rows, the next one
columns, so the model has fewer parameters and does fewer multiply-adds; for a cnn (``net``: Conv2d,
elementwise and pooling layers, then a Linear) the same with output channels. During training
(``edge.prune = "structured"``) the cut neurons are held at zero with masks, shapes unchanged, and
removed when the model is exported.
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


PASS_THROUGH = (
    nn.ReLU,
    nn.GELU,
    nn.Tanh,
    nn.Dropout,
    nn.MaxPool2d,
    nn.AvgPool2d,
    nn.AdaptiveAvgPool2d,
    nn.Flatten,
)
Layer = nn.Linear | nn.Conv2d


def _layers(model: nn.Module) -> list[nn.Module]:
    """The model's layers in order: the mlp's trunk then head(s), or the cnn's net."""
    trunk, head, net = (getattr(model, n, None) for n in ("trunk", "head", "net"))
    if isinstance(trunk, nn.Sequential) and head is not None:
        heads = list(head.values()) if isinstance(head, nn.ModuleDict) else [head]
        return [*trunk, *heads]
    if isinstance(net, nn.Sequential):
        return list(net)
    raise ConfigError(
        f"structured pruning removes hidden neurons of the mlp model (trunk + head) or channels of the "
        f"cnn model (net); {type(model).__name__} is neither: use --prune magnitude"
    )


def _hidden_chain(model: nn.Module) -> list[tuple[Layer, list[Layer]]]:
    """Each hidden Linear / Conv2d with the layers that read its outputs (the next one, or the heads).

    Between two of them only elementwise layers and pooling may sit (each output channel or neuron
    stays one input of the next layer: a cnn's global average pool and flatten turn channel c into
    feature c); the last producer layers are the outputs and are never cut."""
    layers = _layers(model)
    n_heads = 1
    head = getattr(model, "head", None)
    if isinstance(head, nn.ModuleDict):
        n_heads = len(head)
    for layer in layers:
        if not isinstance(layer, (nn.Linear, nn.Conv2d, *PASS_THROUGH)):
            raise ConfigError(
                f"structured pruning: the model holds a {type(layer).__name__}, which it cannot shrink; "
                "use --prune magnitude"
            )
    producers = [m for m in layers if isinstance(m, nn.Linear | nn.Conv2d)]
    hidden, outputs = producers[:-n_heads], producers[len(producers) - n_heads :]
    if not all(isinstance(h, nn.Linear) for h in outputs):
        raise ConfigError("structured pruning: the model's head is not Linear; use --prune magnitude")
    for conv in (m for m in producers if isinstance(m, nn.Conv2d)):
        if conv.groups != 1:
            raise ConfigError("structured pruning: grouped convolutions are not cut; use --prune magnitude")
    return [(p, [hidden[i + 1]] if i + 1 < len(hidden) else outputs) for i, p in enumerate(hidden)]


def _kept(producer: Layer, sparsity: float) -> torch.Tensor | None:
    """The output neurons / channels of ``producer`` that stay (sorted), None when all do: the
    ``sparsity`` share with the smallest L2 norm of their incoming weights is cut (one kept at least)."""
    width = producer.weight.shape[0]
    keep_n = max(1, round(width * (1.0 - sparsity)))
    if keep_n == width:
        return None
    score = producer.weight.detach().flatten(1).norm(dim=1)  # (out,): each output's incoming weight norm
    return torch.sort(torch.topk(score, keep_n).indices).values


def structured_masks(model: nn.Module, sparsity: float) -> dict[nn.Parameter, torch.Tensor]:
    """Zero (in place) the ``sparsity`` share of each hidden layer's outputs: their incoming weights
    and bias, and the next layer's weights that read them; returns the masks to hold them at zero
    with. The shapes stay (what training under DDP needs); :func:`structured_prune` then removes
    exactly these neurons, whose incoming norm is zero."""
    masks: dict[nn.Parameter, torch.Tensor] = {}
    for producer, consumers in _hidden_chain(model):
        keep = _kept(producer, sparsity)
        if keep is None:
            continue
        rows = torch.zeros(producer.weight.shape[0], dtype=producer.weight.dtype)
        rows[keep] = 1.0
        pairs = [(cast(nn.Parameter, producer.weight), rows.view(-1, *[1] * (producer.weight.dim() - 1)))]
        if producer.bias is not None:
            pairs.append((cast(nn.Parameter, producer.bias), rows))
        for consumer in consumers:
            weight = cast(nn.Parameter, consumer.weight)
            pairs.append((weight, rows.view(1, -1, *[1] * (weight.dim() - 2))))
        for param, factor in pairs:
            mask = masks.get(param, torch.ones_like(param)) * factor
            masks[param] = mask
    with torch.no_grad():
        for param, mask in masks.items():
            param.mul_(mask)
    return masks


def structured_prune(model: nn.Module, sparsity: float) -> None:
    """Remove ``sparsity`` of each hidden layer's neurons / channels (one at least kept), smallest
    incoming norm first: the layer loses output rows, the layers reading it input columns."""
    for producer, consumers in _hidden_chain(model):
        keep = _kept(producer, sparsity)
        if keep is None:
            continue
        _shrink(producer, rows=keep)
        for consumer in consumers:
            _shrink(consumer, cols=keep)


def _shrink(layer: Layer, rows: torch.Tensor | None = None, cols: torch.Tensor | None = None) -> None:
    """``layer`` keeps only the output ``rows`` / input ``cols`` given: new, smaller parameters."""
    with torch.no_grad():
        weight = layer.weight  # Linear (out, in), Conv2d (out, in, kh, kw)
        if rows is not None:
            weight = weight[rows]
            if layer.bias is not None:
                layer.bias = nn.Parameter(layer.bias[rows].clone())
            if isinstance(layer, nn.Linear):
                layer.out_features = len(rows)
            else:
                layer.out_channels = len(rows)
        if cols is not None:
            weight = weight[:, cols]
            if isinstance(layer, nn.Linear):
                layer.in_features = len(cols)
            else:
                layer.in_channels = len(cols)
        layer.weight = nn.Parameter(weight.clone())
