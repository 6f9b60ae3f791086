"""``federated.secure_aggregation`` and ``federated.privacy``: what the server sees, what the model leaks."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from vatra.config._sections import Section


class SecureAggregationConfig(Section):
    """Bonawitz et al. (CCS'17) secure aggregation; ``secagg+`` is Bell et al.'s (CCS'20) sparse graph."""

    enabled: bool = Field(False, description="Mask every update so the server learns only the sum.")
    threshold: int = Field(
        0,
        ge=0,
        description="Shamir threshold t: clients that must stay for the round to finish; "
        "0 = ⌈2n/3⌉ of the round's clients (secagg+: of each client's k neighbours + itself).",
    )
    mode: Literal["full", "secagg+"] = Field(
        "full", description="full: every pair of clients shares masks; secagg+: a random k-regular graph."
    )
    neighbours: int = Field(
        8, ge=2, description="secagg+: neighbours k per client (even; raised to n−1 when the round is small)."
    )
    bits: int = Field(32, ge=16, le=32, description="Ring size 2^bits of the masked sums (fixed point).")
    prg: Literal["aes-ctr", "chacha20"] = Field(
        "aes-ctr",
        description="Mask expansion: AES-256-CTR (fastest with AES-NI) or ChaCha20 (fastest without).",
    )
    clip: float = Field(
        1.0, gt=0.0, description="Each update coordinate is clipped to [−clip, clip] before quantization."
    )
    max_weight: int = Field(
        100_000, ge=1, description="Cap on a client's sample count (its weight) in the masked weighted sum."
    )


class PrivacyConfig(Section):
    """Differential privacy: client-level DP-FedAvg or sample-level DP-SGD, with an RDP accountant."""

    mode: Literal["none", "client", "sample"] = Field(
        "none", description="none; client: DP-FedAvg (clip + Gaussian noise per round); sample: DP-SGD."
    )
    clip_norm: float = Field(
        1.0,
        gt=0.0,
        description="L2 clip: of each client's update (client) or each sample's gradient (sample).",
    )
    adaptive_clip: bool = Field(
        False,
        description="client: adapt clip_norm towards the clip_quantile of update norms (Andrew et al.).",
    )
    clip_quantile: float = Field(0.5, gt=0.0, lt=1.0, description="adaptive_clip: target unclipped share.")
    clip_lr: float = Field(0.2, gt=0.0, description="adaptive_clip: geometric step of the clip norm.")
    noise_multiplier: float = Field(
        1.0, ge=0.0, description="Gaussian noise std divided by the clip norm (z); 0 = no noise, ε = ∞."
    )
    delta: float = Field(1e-5, gt=0.0, lt=1.0, description="δ at which ε is reported.")
    target_epsilon: float = Field(
        0.0, ge=0.0, description="Stop before a round would push ε past this; 0 = no budget."
    )
    noise_at: Literal["server", "clients"] = Field(
        "server",
        description="client: the server adds the noise, or each client adds its share "
        "(the sum carries the full noise; needed with secure aggregation).",
    )

    @model_validator(mode="after")
    def _check(self) -> PrivacyConfig:
        if self.mode == "sample" and self.adaptive_clip:
            raise ValueError("adaptive_clip applies to privacy.mode = 'client' only; set it to false")
        return self
