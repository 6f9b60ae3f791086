"""Secure-aggregation messages on the wire: safetensors blobs like every other federated message.

Numpy arrays (masked vectors, uint32 words) travel as tensors. A dict of client id → bytes of one
length (public keys, sealed shares, revealed shares: the bulk of the key traffic, n − 1 entries
per client in full mode) travels as two tensors, the ids (int64) and the bytes as one uint8
matrix, so neither side walks it item by item through JSON. Other bytes travel hex-encoded in
the JSON metadata, other dicts as ``[[key, value], …]``.

Unpacking does not copy tensors out of the message: they are read-only numpy views of the
received bytes (:func:`vatra.federated.wire.decode_views`; a masked vector is only read, summed
into the total), with every header entry checked against the blob's bounds.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from vatra.federated.wire import WireError, decode_views, encode


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
            if _id_bytes(v):
                ids, name = f"t{len(tensors)}", f"t{len(tensors) + 1}"
                tensors[ids] = np.fromiter(v.keys(), dtype=np.int64, count=len(v))
                tensors[name] = np.frombuffer(b"".join(v.values()), dtype=np.uint8).reshape(len(v), -1)
                return {"$kb": [ids, name]}
            return {"$d": [[enc(k), enc(x)] for k, x in v.items()]}
        if isinstance(v, (list, tuple)):
            if set(map(type, v)) <= {int}:  # client ids: plain JSON, no walk
                return list(v)
            return [enc(x) for x in v]
        if isinstance(v, (int, float, str)) or v is None:
            return v
        raise TypeError(f"cannot pack {type(v).__name__}")

    return encode({"kind": "secagg", "stage": stage, "round": rnd, "body": enc(msg)}, tensors)


def unpack(blob: bytes) -> tuple[str, int, dict[str, Any]]:
    meta, tensors = decode_views(blob)
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
            if "$kb" in v:
                return _bytes_table(tensors[v["$kb"][0]], tensors[v["$kb"][1]])
            raise WireError("unknown tagged value in a secure-aggregation message")
        if isinstance(v, list):
            if set(map(type, v)) <= {int}:
                return v
            return [dec(x) for x in v]
        return v

    try:
        return str(meta["stage"]), int(meta["round"]), dec(meta["body"])
    except (KeyError, TypeError, ValueError, IndexError) as err:
        raise WireError(f"malformed secure-aggregation message: {err}") from None


def _id_bytes(d: dict[Any, Any]) -> bool:
    """A non-empty {int: bytes} with every value of one non-zero length."""
    if not d or set(map(type, d)) != {int} or set(map(type, d.values())) != {bytes}:  # C loops, not a walk
        return False
    sizes = set(map(len, d.values()))
    return len(sizes) == 1 and 0 not in sizes


def _bytes_table(ids: np.ndarray, data: np.ndarray) -> dict[int, bytes]:
    if ids.dtype != np.int64 or data.dtype != np.uint8 or ids.ndim != 1 or data.ndim != 2:
        raise WireError("malformed id → bytes table in a secure-aggregation message")
    if data.shape[0] != ids.size or len(set(ids.tolist())) != ids.size:
        raise WireError("id → bytes table: ids and rows do not match one to one")
    raw, size = data.tobytes(), data.shape[1]
    return {cid: raw[i * size : (i + 1) * size] for i, cid in enumerate(ids.tolist())}
