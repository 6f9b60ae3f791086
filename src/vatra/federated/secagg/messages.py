"""Secure-aggregation messages on the wire: safetensors blobs like every other federated message.

Bytes travel hex-encoded in the JSON metadata, dicts keyed by client id as ``[[id, value], …]``,
numpy arrays (masked vectors, uint32 words) as tensors.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from vatra.federated.wire import WireError, decode, encode


def pack(stage: str, rnd: int, msg: dict[str, Any]) -> bytes:
    tensors: dict[str, np.ndarray] = {}

    def enc(v: Any) -> Any:
        if isinstance(v, bytes):
            return {"$b": v.hex()}
        if isinstance(v, np.ndarray):
            name = f"t{len(tensors)}"
            tensors[name] = v
            return {"$t": name}
        if isinstance(v, dict):
            return {"$d": [[enc(k), enc(x)] for k, x in v.items()]}
        if isinstance(v, (list, tuple)):
            return [enc(x) for x in v]
        if isinstance(v, (int, float, str)) or v is None:
            return v
        raise TypeError(f"cannot pack {type(v).__name__}")

    return encode({"kind": "secagg", "stage": stage, "round": rnd, "body": enc(msg)}, tensors)


def unpack(blob: bytes) -> tuple[str, int, dict[str, Any]]:
    meta, tensors = decode(blob)
    if meta.get("kind") != "secagg":
        raise WireError("not a secure-aggregation message")

    def dec(v: Any) -> Any:
        if isinstance(v, dict):
            if "$b" in v:
                return bytes.fromhex(v["$b"])
            if "$t" in v:
                return tensors[v["$t"]]
            if "$d" in v:
                return {dec(k): dec(x) for k, x in v["$d"]}
            raise WireError("unknown tagged value in a secure-aggregation message")
        if isinstance(v, list):
            return [dec(x) for x in v]
        return v

    try:
        return str(meta["stage"]), int(meta["round"]), dec(meta["body"])
    except (KeyError, TypeError, ValueError) as err:
        raise WireError(f"malformed secure-aggregation message: {err}") from None
