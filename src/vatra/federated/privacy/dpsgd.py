"""Sample-level DP-SGD inside a client: opacus computes per-sample gradients, this plugin clips and noises.

opacus's ``GradSampleModule`` hooks the model's layers, so the engine's ``Trainer`` runs its
usual step; after backward every parameter holds ``grad_sample`` (B, …). The plugin replaces
``grad`` by (Σ_i clip(g_i, C) + N(0, (zC)²)) / B — the DP-SGD update of Abadi et al. (2016) —
before the optimizer steps.
"""

from __future__ import annotations

import os

import torch
from opacus import GradSampleModule

from vatra.engine import Plugin, Trainer


class DPSGD(Plugin):
    """One client's DP-SGD for one round; ``gsm`` reuses the hooks already on a reused model."""

    def __init__(
        self,
        model: torch.nn.Module,
        clip_norm: float,
        noise_multiplier: float,
        gsm: GradSampleModule | None = None,
    ) -> None:
        self.clip = clip_norm
        self.z = noise_multiplier
        # opacus hooks the layers; probes under no_grad or eval capture nothing
        self.gsm = gsm if gsm is not None else GradSampleModule(model, loss_reduction="mean")
        self.gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little"))  # not the run seed

    def after_backward(self, trainer: Trainer) -> None:
        params = [p for p in trainer.model.parameters() if p.requires_grad and p.grad_sample is not None]
        batch = params[0].grad_sample.shape[0]
        norms = torch.stack([p.grad_sample.reshape(batch, -1).norm(dim=1) for p in params]).norm(
            dim=0
        )  # (B,)
        factor = (self.clip / (norms + 1e-12)).clamp(max=1.0)  # (B,)
        with torch.no_grad():
            for p in params:
                g = torch.einsum("b,b...->...", factor, p.grad_sample)
                g += torch.normal(0.0, self.z * self.clip, g.shape, generator=self.gen)
                p.grad = g / batch
                p.grad_sample = None
