"""A two-headed model and the overcrowding penalty: the user's code that shelter.toml names."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from vatra.data import DatasetSpec


class ShelterNet(nn.Module):
    """A shared trunk and one head per target: ``adopted`` (a logit) and ``behaviour`` (a score)."""

    def __init__(self, features: int, sites: int, hidden: int) -> None:
        super().__init__()
        self.site = nn.Embedding(sites, 4)
        self.trunk = nn.Sequential(
            nn.Linear(features + 4, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU()
        )
        self.adopted = nn.Linear(hidden, 1)
        self.behaviour = nn.Linear(hidden, 1)

    def forward(self, x: Tensor, ids: Tensor) -> dict[str, Tensor]:
        h = self.trunk(torch.cat([x, self.site(ids[:, 0])], dim=1))  # (B, hidden)
        return {"adopted": self.adopted(h), "behaviour": self.behaviour(h)}  # each (B, 1)


def build(spec: DatasetSpec, hidden: int = 64) -> nn.Module:
    """Inputs are {"x": numeric features, "ids": the site's id} (data.categorical_encoding = "embedding")."""
    return ShelterNet(spec.input_shape[0], spec.categorical["site"], hidden)


def overcrowding(output: dict[str, Tensor], target: dict[str, Tensor]) -> Tensor:
    """Predicted adoption probability, weighted by how far the animal's shelter is over capacity."""
    p = torch.sigmoid(output["adopted"].squeeze(-1))  # (B,)
    over = torch.relu(target["occupancy"] - 1.0)  # (B,), 0 below capacity
    return (p * over).mean()
