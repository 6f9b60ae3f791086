"""Federated learning needs the ``fl`` extra: imported first by the package, one line without it.

Presence is checked without importing (opacus and grpc cost seconds to import; they load when used).
"""

from __future__ import annotations

from vatra._extras import check

for _module in ("safetensors", "grpc", "cryptography", "opacus"):  # the wire, transport, keys, DP
    check(_module, "fl", "federated learning")
