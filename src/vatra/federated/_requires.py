"""Federated learning needs the ``fl`` extra: imported first by the package, one line without it."""

from __future__ import annotations

from vatra._extras import require

for _module in ("safetensors", "grpc", "cryptography", "opacus"):  # the wire, transport, keys, DP
    require(_module, "fl", "federated learning")
