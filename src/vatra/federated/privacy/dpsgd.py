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
        # opacus sets ``grad_sample`` (B, *p.shape) on every trainable parameter after backward
        pairs = [(p, getattr(p, "grad_sample", None)) for p in trainer.model.parameters() if p.requires_grad]
        samples = [(p, g) for p, g in pairs if g is not None]
        batch = samples[0][1].shape[0]
        norms = torch.stack([g.reshape(batch, -1).norm(dim=1) for _, g in samples]).norm(dim=0)  # (B,)
        factor = (self.clip / (norms + 1e-12)).clamp(max=1.0)  # (B,)
        with torch.no_grad():
            for p, g in samples:
                total = torch.einsum("b,b...->...", factor, g)
                total += torch.normal(0.0, self.z * self.clip, total.shape, generator=self.gen)
                p.grad = total / batch
                p.grad_sample = None  # type: ignore[attr-defined]
