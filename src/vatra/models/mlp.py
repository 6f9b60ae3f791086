"""Multi-layer perceptron over the input features: one head, or one named head per multitask target."""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import Tensor, nn

from vatra.config import ModelConfig
from vatra.data import DatasetSpec
from vatra.errors import ConfigError

ACTIVATIONS: dict[str, type[nn.Module]] = {"relu": nn.ReLU, "tanh": nn.Tanh, "gelu": nn.GELU}


def hidden_widths(cfg: ModelConfig) -> list[int]:
    """``model.hidden``, unless ``model.width`` / ``model.depth`` set a uniform stack (what a search
    varies: one width and one depth instead of a list)."""
    if cfg.width is None and cfg.depth is None:
        return cfg.hidden
    width = cfg.width if cfg.width is not None else (cfg.hidden[0] if cfg.hidden else 128)
    return [width] * (cfg.depth if cfg.depth is not None else len(cfg.hidden))


class MLP(nn.Module):
    """Linear + activation (+ Dropout) per hidden width, then a linear head (or a dict of heads).

    The trailing ``len(input_shape)`` dimensions of ``x`` are flattened, so a batch of images
    (B, C, H, W) and a batch of ranking lists (B, L, F) both work: a list's items are scored one by
    one. Categorical ids (``ids``: (..., n_categorical) int64, 0 = unseen) are embedded and joined
    to the numeric features.
    """

    def __init__(
        self,
        in_features: int,
        hidden: list[int],
        num_classes: int | Mapping[str, int],
        dropout: float = 0.0,
        *,
        input_dims: int = 1,
        categorical: Mapping[str, int] | None = None,
        embedding_dim: int = 8,
        activation: str = "relu",
    ) -> None:
        super().__init__()
        self.input_dims = input_dims
        self.embeddings = nn.ModuleList(nn.Embedding(n, embedding_dim) for n in (categorical or {}).values())
        width = in_features + embedding_dim * len(self.embeddings)
        layers: list[nn.Module] = []
        for h in hidden:
            layers += [nn.Linear(width, h), ACTIVATIONS[activation]()]
            if dropout > 0:
                layers.append(nn.Dropout(dropout))
            width = h
        self.trunk = nn.Sequential(*layers)
        self.head: nn.Module
        if isinstance(num_classes, Mapping):
            self.head = nn.ModuleDict({name: nn.Linear(width, n) for name, n in num_classes.items()})
        else:
            self.head = nn.Linear(width, num_classes)

    def forward(self, x: Tensor, ids: Tensor | None = None) -> Tensor | dict[str, Tensor]:
        x = x.flatten(start_dim=x.dim() - self.input_dims)  # (B, ..., *input_shape) -> (B, ..., F)
        if self.embeddings:
            if ids is None:
                raise ValueError("this MLP embeds categorical features: pass inputs {'x': ..., 'ids': ...}")
            embedded = [emb(ids[..., i]) for i, emb in enumerate(self.embeddings)]  # each (B, ..., E)
            x = torch.cat([x, *embedded], dim=-1)
        h = self.trunk(x)
        if isinstance(self.head, nn.ModuleDict):
            return {name: head(h) for name, head in self.head.items()}
        return self.head(h)  # (B, ..., num_classes)


def head_sizes(cfg_heads: Mapping[str, int], spec: DatasetSpec) -> dict[str, int]:
    """Output width of each multitask head: the config's ``size``, else the data spec's."""
    sizes: dict[str, int] = {}
    for name in spec.heads or cfg_heads:
        size = cfg_heads.get(name) or (spec.heads[name].size if name in spec.heads else 0)
        if size < 1:
            raise ConfigError(
                f"train.multitask.heads.{name}.size: the data does not say how many outputs head {name!r} "
                "needs; set size"
            )
        sizes[name] = size
    return sizes


def build_mlp(cfg: ModelConfig, spec: DatasetSpec, heads: Mapping[str, int] | None = None) -> MLP:
    if spec.kind == "lm":
        raise ConfigError("model.name: 'mlp' does not model language; use gpt for text")
    out: int | dict[str, int]
    if spec.kind == "multitask":
        out = head_sizes(heads or {}, spec)
    else:
        out = spec.num_classes
        if out < 1:
            raise ConfigError(
                "model.name: 'mlp' needs the number of outputs, which the data does not say; give the "
                "dataset a num_classes attribute, return a DatasetSpec from the data factory, or use "
                "your own model"
            )
    return MLP(
        math.prod(spec.input_shape),
        hidden_widths(cfg),
        out,
        cfg.dropout,
        input_dims=len(spec.input_shape),
        categorical=spec.categorical,
        embedding_dim=cfg.embedding_dim,
        activation=cfg.activation,
    )
