"""Messages on the wire: safetensors bytes (tensors as raw little-endian buffers, JSON metadata).

Never pickle: a message is a safetensors blob whose ``__metadata__`` holds one JSON document
under ``"meta"``. Decoding checks the header before reading any tensor, so a malformed message
raises :class:`WireError` instead of executing anything.

Messages the server only reads (fit results, secure-aggregation replies) are decoded by
:func:`decode_views`: their tensors are read-only numpy views of the received bytes, not copies
(a 440 kB update costs no copy to check and average; writing into one raises).

A peer's message cannot crash or steer the reader: every malformed input raises
:class:`WireError` (never another exception type), so the caller drops just that message with the
reason. JSON nested deeper than :data:`MAX_DEPTH` is refused before parsing; received messages
(:func:`decode_views`) refuse the non-standard constants ``NaN``/``Infinity``; a fit result has a
bounded header, exactly an ``update`` tensor plus the ``payload.*`` names its upload hook accepts,
and metrics of plain types (:func:`check_metrics`).
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load, save

from vatra.federated._base import EvalRes, FitIns, FitRes
from vatra.federated.edgesync import Int8Download, pack_int8, unpack_int8

MAX_HEADER = 100 * 1024 * 1024
MAX_RES_HEADER = 1024 * 1024  # a fit result's header: tensor entries + metrics (a few kB in practice)
MAX_DEPTH = 32  # JSON nesting; vatra's own messages (secure aggregation included) stay under 8
MAX_INT = 2**53  # ints a peer sends must convert to float exactly (float(10**400) raises)
MAX_METRICS = 64  # metrics per fit result
MAX_TEXT = 256  # characters of a metric name or string value
MAX_LIST = 64  # items of a list-valued metric
MAX_DIMS = 32  # dimensions of a received tensor (numpy holds at most 64; vatra's messages use 1 or 2)
MAX_DIM = 2**62  # one dimension's size: a zero-size tensor may name any, numpy refuses ≥ 2^63
# Metrics the server itself reads as numbers (server, selectors, strategies, upload hooks).
INT_METRICS = frozenset({"model", "update_floats", "dp_unclipped", "data_version"})
FLOAT_METRICS = frozenset(
    {"loss_before", "loss_after", "train_loss", "train_time_s", "duration_s", "local_accuracy", "update_norm"}
)


class WireError(ValueError):
    """A message that cannot be decoded."""


_DTYPES = {
    name: np.dtype(code)
    for name, code in {
        "BOOL": "?", "U8": "u1", "I8": "i1", "U16": "<u2", "I16": "<i2", "F16": "<f2", "U32": "<u4",
        "I32": "<i4", "F32": "<f4", "U64": "<u8", "I64": "<i8", "F64": "<f8",
    }.items()
}  # fmt: skip


_STRING = re.compile(rb'"[^"]*"')
_NOT_BRACKET = bytes(sorted(set(range(256)) - set(b"[]{}")))
_CHUNK = 1 << 20


def json_depth(text: bytes) -> int:
    """Deepest nesting of ``[`` and ``{`` in a JSON document, without parsing it.

    Byte-level passes that run at C speed: drop escaped backslashes and quotes, then strings,
    then everything but brackets, and take the running maximum of opens minus closes. Exact for
    valid JSON; an invalid document is refused by the parser anyway.
    """
    bare = _STRING.sub(b"", text.replace(b"\\\\", b"").replace(b'\\"', b""))
    steps = np.frombuffer(bare.translate(None, _NOT_BRACKET), dtype=np.uint8)
    depth = deepest = 0
    for i in range(0, steps.size, _CHUNK):  # chunks: a 100 MB header of brackets needs no 800 MB cumsum
        part = steps[i : i + _CHUNK]
        running = depth + np.cumsum(np.where((part == ord("[")) | (part == ord("{")), 1, -1))
        deepest, depth = max(deepest, int(running.max())), int(running[-1])
    return deepest


def _no_constant(name: str) -> Any:
    raise WireError(f"metadata holds the non-standard JSON constant {name}")


def _loads(text: str | bytes, what: str, *, strict: bool) -> Any:
    """``json.loads`` that raises only :class:`WireError`; ``strict`` refuses NaN and ±Infinity."""
    raw = text.encode() if isinstance(text, str) else text
    if json_depth(raw) > MAX_DEPTH:
        raise WireError(f"{what} is nested deeper than {MAX_DEPTH} levels")
    try:
        return json.loads(raw, parse_constant=_no_constant if strict else None)
    except WireError:
        raise
    except (ValueError, RecursionError) as err:  # UnicodeDecodeError is a ValueError
        raise WireError(f"undecodable message: {what} is not valid JSON: {err}") from None


def _split(blob: bytes, *, strict: bool) -> tuple[int, dict[str, Any], dict[str, Any]]:
    """(header length, tensor header entries, metadata) of a safetensors message."""
    if not isinstance(blob, bytes) or len(blob) < 8:
        raise WireError("message shorter than a safetensors header")
    (n,) = struct.unpack_from("<Q", blob)
    if n > MAX_HEADER or 8 + n > len(blob):
        raise WireError("safetensors header length out of range")
    header = _loads(blob[8 : 8 + n], "safetensors header", strict=strict)
    if not isinstance(header, dict):
        raise WireError("safetensors header is not a JSON object")
    extra = header.pop("__metadata__", None) or {}
    text = extra.get("meta", "{}") if isinstance(extra, dict) else None
    if not isinstance(text, str):
        raise WireError("message metadata is not a JSON string under __metadata__.meta")
    meta = _loads(text, "message metadata", strict=strict)
    if not isinstance(meta, dict):
        raise WireError("message metadata is not a JSON object")
    return n, header, meta


def encode(meta: dict[str, Any], tensors: dict[str, np.ndarray] | None = None) -> bytes:
    arrays = {k: np.ascontiguousarray(v) for k, v in (tensors or {}).items()}
    return save(arrays, metadata={"meta": json.dumps(meta, default=float)})


def decode(blob: bytes) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Metadata and tensor copies; for trusted bytes (the server's checkpoint, the server's replies).

    Non-standard constants are allowed: a checkpoint's metrics may hold ε = Infinity.
    """
    _, _, meta = _split(blob, strict=False)
    try:
        tensors = load(blob)
    except (SafetensorError, ValueError, TypeError, KeyError, OverflowError) as err:
        raise WireError(f"undecodable message: {err}") from None
    return meta, tensors


def decode_views(blob: bytes) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """:func:`decode` without copies, for received messages: the tensors are read-only views of ``blob``."""
    n, header, meta = _split(blob, strict=True)
    start, size = 8 + n, len(blob) - 8 - n
    tensors: dict[str, np.ndarray] = {}
    for name, info in header.items():
        try:
            dtype = _DTYPES[info["dtype"]]
            shape = [int(d) for d in info["shape"]]
            lo, hi = (int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError, OverflowError):
            raise WireError(f"tensor {name!r}: unsupported or malformed header entry") from None
        if len(shape) > MAX_DIMS or not all(0 <= d <= MAX_DIM for d in shape):
            raise WireError(
                f"tensor {_short(name)}: shape {_short(shape)}: over {MAX_DIMS} dimensions, "
                "or a dimension negative or over 2^62"
            )
        count = math.prod(shape)
        if not 0 <= lo <= hi <= size or hi - lo != count * dtype.itemsize:
            raise WireError(f"tensor {_short(name)}: offsets do not match its shape and the message size")
        try:
            if count == 0:
                tensors[name] = np.zeros(shape, dtype=dtype)
            else:
                tensors[name] = np.frombuffer(blob, dtype=dtype, count=count, offset=start + lo).reshape(
                    shape
                )
        except (
            ValueError,
            OverflowError,
            MemoryError,
        ) as err:  # numpy's own limits, whatever the checks above miss
            raise WireError(
                f"tensor {_short(name)}: shape {_short(shape)} is not one numpy can hold: {err}"
            ) from None
    return meta, tensors


def encode_ins(ins: FitIns, int8: Int8Download | None = None) -> bytes:
    """A fit instruction; with ``int8`` (the model's parameter shapes, optionally a share cut) its
    models travel as int8 with per-row scales (:func:`vatra.federated.edgesync.pack_int8`)."""
    meta = {"kind": "fit_ins", "client_id": ins.client_id, "round": ins.round, "config": ins.config}
    meta["models"] = len(ins.models)
    if int8 is None:
        return encode(meta, {f"model.{i}": m for i, m in enumerate(ins.models)})
    meta["int8_chunks"] = len(int8.shapes)
    return encode(
        meta, {k: v for i, m in enumerate(ins.models) for k, v in pack_int8(m, int8, f"model.{i}").items()}
    )


def decode_ins(blob: bytes) -> FitIns:
    meta, tensors = decode(blob)
    try:
        if meta.get("kind", "fit_ins") != "fit_ins" or not isinstance(meta["config"], dict):
            raise WireError("not a fit instruction (kind fit_ins with a config object)")
        chunks = meta.get("int8_chunks")
        if chunks is not None:  # an int8 download: the client trains from (and runs) the dequantized model
            models = [unpack_int8(tensors, f"model.{i}", int(chunks)) for i in range(int(meta["models"]))]
        else:
            models = [tensors[f"model.{i}"] for i in range(int(meta["models"]))]
        return FitIns(int(meta["client_id"]), int(meta["round"]), models, dict(meta["config"]))
    except (KeyError, TypeError, ValueError, OverflowError) as err:
        raise WireError(f"fit instruction is incomplete: {err!r}") from None


def encode_res(res: FitRes) -> bytes:
    meta = {
        "kind": "fit_res",
        "client_id": res.client_id,
        "round": res.round,
        "num_samples": res.num_samples,
        "metrics": res.metrics,
    }
    return encode(meta, {"update": res.update, **{f"payload.{k}": v for k, v in res.payload.items()}})


def _peer_int(meta: dict[str, Any], key: str, what: str) -> int:
    v = meta.get(key)
    if type(v) is not int or not -MAX_INT <= v <= MAX_INT:  # not bool, not float, not 10**400
        raise WireError(f"{what} {key} must be an integer of at most 2^53, got {_short(v)}")
    return v


def _small_header(blob: bytes, what: str) -> bytes:
    """``blob``, unless its header is over :data:`MAX_RES_HEADER` (refused before any parsing)."""
    if isinstance(blob, bytes) and len(blob) >= 8 and struct.unpack_from("<Q", blob)[0] > MAX_RES_HEADER:
        raise WireError(f"{what} header over {MAX_RES_HEADER} bytes")
    return blob


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def decode_res(blob: bytes, allowed_payload: Callable[[str], bool] | None = None) -> FitRes:
    """Decode and check the message's form; shape, dtype and finiteness are :func:`check_update`'s.

    Refused (:class:`WireError`): a header over :data:`MAX_RES_HEADER`, any tensor other than
    ``update`` and ``payload.<name>``, a payload name ``allowed_payload`` rejects (None: any name;
    the server passes its upload hook's rule, :func:`vatra.federated.grpc.guard.payload_rule`), ids and
    counts that are not integers, and metrics :func:`check_metrics` refuses. The update and payload
    tensors are read-only views of ``blob`` (:func:`decode_views`).
    """
    meta, tensors = decode_views(_small_header(blob, "fit result"))
    if meta.get("kind") != "fit_res" or "update" not in tensors:
        raise WireError("not a fit result (kind fit_res with an 'update' tensor)")
    payload: dict[str, np.ndarray] = {}
    for key, tensor in tensors.items():
        if key == "update":
            continue
        name = key.removeprefix("payload.")
        if name == key or (allowed_payload is not None and not allowed_payload(name)):
            raise WireError(f"fit result carries an unexpected tensor {_short(key)}")
        payload[name] = tensor
    metrics = meta.get("metrics", {})
    reason = check_metrics(metrics)
    if reason is not None:
        raise WireError(reason)
    cid, rnd, n = (_peer_int(meta, k, "fit result") for k in ("client_id", "round", "num_samples"))
    return FitRes(cid, rnd, n, tensors["update"], dict(metrics), payload)


def _plain(v: Any) -> bool:
    """A finite bool/int/float or a short string (what a metric value may be, list items too)."""
    if isinstance(v, bool):
        return True
    if isinstance(v, int):
        return -MAX_INT <= v <= MAX_INT
    if isinstance(v, float):
        return math.isfinite(v)
    return isinstance(v, str) and len(v) <= MAX_TEXT


def check_metrics(metrics: Any, *, numbers_only: bool = False) -> str | None:
    """Why a client's metrics must be refused, or None when they are acceptable.

    At most :data:`MAX_METRICS` entries with string names of at most :data:`MAX_TEXT` characters;
    values are finite ints (|v| ≤ 2^53), floats, bools, strings of at most :data:`MAX_TEXT`
    characters, or lists of at most :data:`MAX_LIST` of those. The names the server reads as
    numbers (:data:`INT_METRICS`, :data:`FLOAT_METRICS`) must hold numbers of that kind;
    ``numbers_only`` (evaluation reports, averaged across clients) requires that of every value.
    """
    if not isinstance(metrics, Mapping):
        return f"metrics must be a JSON object, got {type(metrics).__name__}"
    if len(metrics) > MAX_METRICS:
        return f"{len(metrics)} metrics, at most {MAX_METRICS} allowed"
    for name, v in metrics.items():
        if not isinstance(name, str) or len(name) > MAX_TEXT:
            return f"metric name {_short(name)} is not a string of at most {MAX_TEXT} characters"
        if isinstance(v, list):
            if len(v) > MAX_LIST or not all(_plain(x) for x in v):
                return f"metric {name!r}: a list of at most {MAX_LIST} finite numbers or short strings"
        elif not _plain(v):
            return f"metric {name!r} = {_short(v)}: not a finite number, a bool or a short string"
        if name in INT_METRICS and (type(v) is not int):
            return f"metric {name!r} = {_short(v)} must be an integer"
        if (numbers_only or name in FLOAT_METRICS) and (
            isinstance(v, bool) or not isinstance(v, int | float)
        ):
            return f"metric {name!r} = {_short(v)} must be a number"
    return None


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


def encode_eval_res(res: EvalRes) -> bytes:
    meta = {
        "kind": "eval_res",
        "client_id": res.client_id,
        "round": res.round,
        "num_examples": res.num_examples,
        "metrics": res.metrics,
    }
    return encode(meta)


RATIO_METRICS = ("accuracy", "auc", "macro_f1", "ndcg@")  # vatra.losses' shares (ndcg@k for any k)


def decode_eval_res(blob: bytes) -> EvalRes:
    """A client's evaluation report: metadata only, every metric a finite number (:func:`check_metrics`)."""
    meta, tensors = decode_views(_small_header(blob, "evaluation report"))
    if meta.get("kind") != "eval_res" or tensors:
        raise WireError("not an evaluation report (kind eval_res, no tensors)")
    what = "evaluation report"
    cid, rnd, n = (_peer_int(meta, k, what) for k in ("client_id", "round", "num_examples"))
    reason = check_metrics(meta.get("metrics"), numbers_only=True)
    if reason is not None or n < 0:
        raise WireError(f"{what}: {reason or f'num_examples {n} must be ≥ 0'}")
    metrics = dict(meta["metrics"])
    # shares (accuracy, F1, AUC, ...) lie in [0, 1]: a report outside it would skew the round's averages
    for key in (k for k in metrics if k in RATIO_METRICS or k.startswith("ndcg@")):
        if not 0.0 <= float(metrics[key]) <= 1.0:
            raise WireError(f"{what}: {key} = {metrics[key]!r} is outside [0, 1]")
    return EvalRes(cid, rnd, n, metrics)
