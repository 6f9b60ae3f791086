"""``federated.secure_aggregation`` and ``federated.privacy``: what the server sees, what the model leaks."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field, field_validator, model_validator

from vatra.config._sections import Section


class SecureAggregationConfig(Section):
    """Bonawitz et al. (CCS'17) secure aggregation; ``secagg+`` is Bell et al.'s (CCS'20) sparse graph.

    Each client shares its secrets among h holders (h = n in full mode, k + 1 in secagg+) with a
    threshold t that must be a strict majority of them, t > h/2: an honest holder reveals, per
    client, a share of one secret or of the other, never both, so two disjoint sets of ≥ t
    holders (one per secret) cannot exist. Clients check t themselves (:meth:`threshold_for`)
    and refuse a round whose t is below their own.
    """

    enabled: bool = Field(False, description="Mask every update so the server learns only the sum.")
    threshold: int = Field(
        0,
        ge=0,
        description="Shamir threshold t: clients that must stay for the round to finish; "
        "0 = ⌈2h/3⌉ of the h share holders (full: the round's n clients; secagg+: k neighbours + "
        "itself). Set explicitly it must be more than h/2 (secagg+: more than (k + 1)/2).",
    )
    mode: Literal["full", "secagg+"] = Field(
        "full", description="full: every pair of clients shares masks; secagg+: a random k-regular graph."
    )
    neighbours: int = Field(
        8,
        ge=2,
        description="secagg+: neighbours k per client (even, ≥ 2; a round of n ≤ k + 1 clients is full).",
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

    @field_validator("neighbours")
    @classmethod
    def _even(cls, k: int) -> int:
        if k % 2:
            raise ValueError(f"neighbours = {k}: the k-regular circulant graph needs an even k; use {k + 1}")
        return k

    @model_validator(mode="after")
    def _check(self) -> SecureAggregationConfig:
        if self.mode == "secagg+" and self.threshold:
            k = self.neighbours
            if not (k + 1) / 2 < self.threshold <= k + 1:
                raise ValueError(
                    f"secure_aggregation.threshold = {self.threshold} with neighbours = {k}: each secret "
                    f"has k + 1 = {k + 1} holders, so t must be in ({(k + 1) / 2:g}, {k + 1}]; "
                    "or 0 for ⌈2(k+1)/3⌉"
                )
        return self

    def check_ring(self, clients: int, *, weighted: bool) -> None:
        """ValueError unless a round of ``clients`` fits the ring: each client's update words get at
        least one of the 2^(bits−1) − 1 quantization steps of the signed sum (it never wraps), and
        the summed weight, ≤ max_weight per client (1 unweighted) in a 32-bit word, stays < 2^32."""
        steps = (1 << (self.bits - 1)) - 1
        if clients > steps:
            raise ValueError(
                f"secure_aggregation.bits = {self.bits}: a round of {clients} clients needs at least "
                f"{clients} quantization steps, the {self.bits}-bit sum holds {steps}; "
                f"set bits to {clients.bit_length() + 1} or more"
            )
        if weighted and self.max_weight * clients >= 1 << 32:
            raise ValueError(
                f"secure_aggregation.max_weight = {self.max_weight}: {clients} clients' summed weight "
                f"could reach {self.max_weight * clients}, past the 32-bit weight word; set max_weight "
                f"to {((1 << 32) - 1) // clients} or less"
            )

    def holders_for(self, clients: int) -> int:
        """Holders h of each client's shares in a round of ``clients``: all of them, or k + 1 (secagg+)."""
        if self.mode == "full" or self.neighbours >= clients - 1:
            return clients
        return self.neighbours + 1

    def threshold_for(self, holders: int) -> int:
        """t for secrets shared among ``holders``; ValueError if the configured t is no majority of them."""
        t = self.threshold or math.ceil(2 * holders / 3)
        if t <= holders / 2:
            raise ValueError(
                f"secure_aggregation.threshold = {t} is not more than half of the {holders} share holders: "
                f"a server could then collect both secrets of a client; set it above {holders / 2:g} "
                "(or 0 for ⌈2h/3⌉)"
            )
        return t


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
