"""Messages on the wire: safetensors bytes (tensors as raw little-endian buffers, JSON metadata).

Never pickle: a message is a safetensors blob whose ``__metadata__`` holds one JSON document
under ``"meta"``. Decoding checks the header before reading any tensor, so a malformed message
raises :class:`WireError` instead of executing anything.

Messages the server only reads (fit results, secure-aggregation replies) are decoded by
:func:`decode_views`: their tensors are read-only numpy views of the received bytes, not copies
(a 440 kB update costs no copy to check and average; writing into one raises).
"""

from __future__ import annotations

import json
import math
import struct
from typing import Any

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load, save

from vatra.federated._base import FitIns, FitRes

MAX_HEADER = 100 * 1024 * 1024


class WireError(ValueError):
    """A message that cannot be decoded."""


_DTYPES = {
    name: np.dtype(code)
    for name, code in {
        "BOOL": "?", "U8": "u1", "I8": "i1", "U16": "<u2", "I16": "<i2", "F16": "<f2", "U32": "<u4",
        "I32": "<i4", "F32": "<f4", "U64": "<u8", "I64": "<i8", "F64": "<f8",
    }.items()
}  # fmt: skip


def encode(meta: dict[str, Any], tensors: dict[str, np.ndarray] | None = None) -> bytes:
    arrays = {k: np.ascontiguousarray(v) for k, v in (tensors or {}).items()}
    return save(arrays, metadata={"meta": json.dumps(meta, default=float)})


def decode(blob: bytes) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    if len(blob) < 8:
        raise WireError("message shorter than a safetensors header")
    (n,) = struct.unpack("<Q", blob[:8])
    if n > MAX_HEADER or 8 + n > len(blob):
        raise WireError("safetensors header length out of range")
    try:
        header = json.loads(blob[8 : 8 + n])
        meta = json.loads(header.get("__metadata__", {}).get("meta", "{}"))
        tensors = load(blob)
    except (ValueError, SafetensorError, AttributeError) as err:
        raise WireError(f"undecodable message: {err}") from None
    if not isinstance(meta, dict):
        raise WireError("message metadata is not a JSON object")
    return meta, tensors


def decode_views(blob: bytes) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """:func:`decode` without copies: the tensors are read-only views of ``blob``."""
    if not isinstance(blob, bytes) or len(blob) < 8:
        raise WireError("message shorter than a safetensors header")
    (n,) = struct.unpack_from("<Q", blob)
    if n > MAX_HEADER or 8 + n > len(blob):
        raise WireError("safetensors header length out of range")
    try:
        header = json.loads(blob[8 : 8 + n])
        meta = json.loads(header.pop("__metadata__", {}).get("meta", "{}"))
    except (ValueError, AttributeError, TypeError) as err:
        raise WireError(f"undecodable message: {err}") from None
    if not isinstance(meta, dict):
        raise WireError("message metadata is not a JSON object")
    start, size = 8 + n, len(blob) - 8 - n
    tensors: dict[str, np.ndarray] = {}
    for name, info in header.items():
        try:
            dtype = _DTYPES[info["dtype"]]
            shape = [int(d) for d in info["shape"]]
            lo, hi = (int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise WireError(f"tensor {name!r}: unsupported or malformed header entry") from None
        count = math.prod(shape)
        if min(shape, default=0) < 0 or not 0 <= lo <= hi <= size or hi - lo != count * dtype.itemsize:
            raise WireError(f"tensor {name!r}: offsets do not match its shape and the message size")
        if count == 0:
            tensors[name] = np.zeros(shape, dtype=dtype)
            continue
        tensors[name] = np.frombuffer(blob, dtype=dtype, count=count, offset=start + lo).reshape(shape)
    return meta, tensors


def encode_ins(ins: FitIns) -> bytes:
    meta = {"kind": "fit_ins", "client_id": ins.client_id, "round": ins.round, "config": ins.config}
    meta["models"] = len(ins.models)
    return encode(meta, {f"model.{i}": m for i, m in enumerate(ins.models)})


def decode_ins(blob: bytes) -> FitIns:
    meta, tensors = decode(blob)
    models = [tensors[f"model.{i}"] for i in range(int(meta["models"]))]
    return FitIns(int(meta["client_id"]), int(meta["round"]), models, dict(meta["config"]))


def encode_res(res: FitRes) -> bytes:
    meta = {
        "kind": "fit_res",
        "client_id": res.client_id,
        "round": res.round,
        "num_samples": res.num_samples,
        "metrics": res.metrics,
    }
    return encode(meta, {"update": res.update, **{f"payload.{k}": v for k, v in res.payload.items()}})


def decode_res(blob: bytes) -> FitRes:
    """Decode only; shape, dtype and finiteness are checked by :func:`check_update`.

    The update and payload tensors are read-only views of ``blob`` (:func:`decode_views`).
    """
    meta, tensors = decode_views(blob)
    if meta.get("kind") != "fit_res" or "update" not in tensors:
        raise WireError("not a fit result (kind fit_res with an 'update' tensor)")
    try:
        return FitRes(
            int(meta["client_id"]),
            int(meta["round"]),
            int(meta["num_samples"]),
            tensors["update"],
            dict(meta.get("metrics", {})),
            {k.removeprefix("payload."): v for k, v in tensors.items() if k.startswith("payload.")},
        )
    except (KeyError, TypeError, ValueError) as err:
        raise WireError(f"fit result metadata is incomplete: {err}") from None


def check_update(res: FitRes, expected: int) -> str | None:
    """Why this update must be rejected, or None when it is acceptable."""
    u = res.update
    if u.dtype != np.float32:
        return f"update dtype {u.dtype}, expected float32"
    if u.shape != (expected,):
        return f"update shape {tuple(u.shape)}, expected ({expected},)"
    if not np.isfinite(u).all():
        return f"update has {int((~np.isfinite(u)).sum())} non-finite values (NaN/inf)"
    if res.num_samples < 1:
        return f"num_samples {res.num_samples} must be ≥ 1"
    return None
