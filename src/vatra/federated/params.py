"""Model weights as one flat float32 vector, in a fixed parameter order (the wire and aggregation form)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn


@dataclass(frozen=True)
class ParamLayout:
    """Names and shapes of a model's parameters in ``named_parameters()`` order.

    ``flatten`` / ``load`` convert between a model and its flat vector; ``split`` gives the
    per-tensor views of a vector as an ordered dict, for code that wants state-dict form.
    Buffers are not part of the vector: the built-in models have none that training changes.
    """

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, model: nn.Module) -> ParamLayout:
        named = list(model.named_parameters())
        return cls(tuple(n for n, _ in named), tuple(tuple(p.shape) for _, p in named))

    @property
    def sizes(self) -> list[int]:
        return [int(np.prod(s)) for s in self.shapes]

    @property
    def size(self) -> int:
        return sum(self.sizes)

    def head_size(self, tensors: int) -> int:
        """Length of the trailing part of the vector that holds the last ``tensors`` parameters."""
        return sum(self.sizes[len(self.sizes) - tensors :]) if tensors else 0

    def flatten(self, model: nn.Module) -> np.ndarray:
        with torch.no_grad():
            parts = [p.detach().reshape(-1).to(torch.float32).cpu() for p in model.parameters()]
        return torch.cat(parts).numpy().copy()

    def load(self, model: nn.Module, vec: np.ndarray) -> None:
        """Copy ``vec`` (length ``size``) into the model's parameters."""
        if vec.shape != (self.size,):
            raise ValueError(f"weight vector has shape {vec.shape}, the model needs ({self.size},)")
        flat = torch.from_numpy(np.ascontiguousarray(vec, dtype=np.float32))
        offset = 0
        with torch.no_grad():
            for p, n in zip(model.parameters(), self.sizes, strict=True):
                p.copy_(flat[offset : offset + n].view_as(p))
                offset += n

    def split(self, vec: np.ndarray) -> dict[str, np.ndarray]:
        """Ordered ``{name: array of its shape}`` views into ``vec``."""
        out: dict[str, np.ndarray] = {}
        offset = 0
        for name, shape, n in zip(self.names, self.shapes, self.sizes, strict=True):
            out[name] = vec[offset : offset + n].reshape(shape)
            offset += n
        return out
