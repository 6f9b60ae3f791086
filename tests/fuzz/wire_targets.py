"""Fuzz targets for what a peer sends: the federated wire messages and the secure-aggregation messages.

Property: whatever the bytes, each reader returns or raises :class:`~vatra.federated.wire.WireError`
(the join's data spec: ValueError, which ``join`` turns into a refusal), never anything else.
"""

from __future__ import annotations

import contextlib
import json
import struct
import threading
from types import SimpleNamespace
from typing import Any

import numpy as np
from tests.fuzz._harness import Target, frame_seeds, framed

from vatra.data._base import DatasetSpec, TargetSpec
from vatra.federated._base import EvalRes, FitIns, FitRes
from vatra.federated.data import spec_from_json, spec_to_json
from vatra.federated.grpc.stages import secagg_reply
from vatra.federated.secagg.crypto import SEALED_BYTES, SHARE_BYTES
from vatra.federated.secagg.messages import BytesTable, pack, unpack
from vatra.federated.wire import (
    WireError,
    decode,
    decode_eval_res,
    decode_ins,
    decode_res,
    decode_views,
    encode,
    encode_eval_res,
    encode_ins,
    encode_res,
)

WIRE_TOKENS = [
    b'"__metadata__"', b'"meta"', b'"dtype"', b'"shape"', b'"data_offsets"', b'"F32"', b'"U8"', b'"I64"',
    b'"BOOL"', b'"kind"', b'"fit_res"', b'"eval_res"', b'"fit_ins"', b'"join"', b'"update"',
    b'"payload.0.raw"', b'"model.0"', b'"models"', b'"metrics"', b'"num_samples"', b'"num_examples"',
    b'"client_id"', b'"round"',
    b'"config"', b'"spec"', b'"input_shape"', b'"heads"', b'"categorical"', b'"accuracy"', b'"ndcg@5"',
    b"NaN", b"Infinity", b"true", b"null", b"[]", b"{}", b'\\"',
]  # fmt: skip
SECAGG_TOKENS = [
    b'"secagg"', b'"stage"', b'"body"', b'"$b"', b'"$t"', b'"$d"', b'"$kb"', b'"advertise"', b'"share_keys"',
    b'"masked_input"', b'"unmask"', b'"c_pk"', b'"s_pk"', b'"ciphertexts"', b'"b_commit"', b'"y"',
    b'"b_shares"', b'"s_shares"', b'"error"', b'"t0"', b'"t1"', b'"I64"', b'"U8"', b'"U32"',
]  # fmt: skip


def _wire_messages() -> list[bytes]:
    spec = DatasetSpec(
        "classification", (8,), 3, heads={"y": TargetSpec("classification", 3)}, categorical={"c": 4}
    )
    metrics = {"loss_before": 2.3, "loss_after": 1.9, "model": 0, "tags": ["a", 1]}
    update = np.arange(6, dtype=np.float32)
    return [
        encode_res(FitRes(1, 2, 30, update, metrics)),
        encode_res(
            FitRes(1, 2, 30, update, {}, {"0.raw": np.ones(3, np.float32), "0.0": np.zeros(2, np.uint8)})
        ),
        encode_eval_res(EvalRes(1, 2, 7, {"accuracy": 0.5, "loss": 0.7, "ndcg@5": 0.25})),
        encode_ins(FitIns(1, 2, [np.zeros(6, np.float32), np.ones(6, np.float32)], {"local_steps": 3})),
        encode({"kind": "join", "spec": spec_to_json(spec), "num_train": 100}),
        encode({"kind": "wait"}),
    ]


def tensor_message(kind: str, shape: list[int], data: bytes = b"") -> bytes:
    """A message with one tensor ``update`` of ``shape``, written by hand (no encoder writes a bad one)."""
    meta = {"kind": kind, "client_id": 1, "round": 1, "num_samples": 1, "num_examples": 1, "metrics": {}}
    meta |= {"stage": "advertise", "body": {}}
    header = {
        "__metadata__": {"meta": json.dumps(meta)},
        "update": {"dtype": "F32", "shape": shape, "data_offsets": [0, len(data)]},
    }
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


def _shape_findings() -> list[bytes]:
    """Shapes numpy refuses with ValueError (issue 34, item 7): 65 dimensions; zero-size, past 2^63."""
    return [
        b"\x00" + tensor_message(kind, shape, data)
        for kind in ("fit_res", "eval_res", "secagg")
        for shape, data in (([1] * 65, b"\0" * 4), ([0, 2**63], b""), ([0, 2**62, 2**62], b""))
    ]


WIRE_BESIDE = [  # tensors a fuzzed metadata text travels with: a fit result's, a fit instruction's, none
    encode({}, {"update": np.zeros(6, np.float32), "payload.0.raw": np.ones(3, np.float32)}),
    encode({}, {"model.0": np.zeros(6, np.float32), "model.1": np.ones(6, np.float32)}),
    encode({}),
]


def _wire_seeds() -> list[bytes]:
    return frame_seeds(_wire_messages(), WIRE_BESIDE)


def wire_one_input(data: bytes) -> None:
    """Every reader of a received or stored message, and the join's data spec, on the same bytes."""
    data = framed(data, WIRE_BESIDE)
    for read in (decode, decode_views, decode_ins, decode_res, decode_eval_res):
        with contextlib.suppress(WireError):
            read(data)
    try:
        meta, _ = decode_views(data)
    except WireError:
        return
    with contextlib.suppress(ValueError):  # what Hub.join does with the meta of a join
        spec_from_json(meta.get("spec"))


class _Refused(Exception):
    """What the fake gRPC context raises for ``abort`` (grpc raises its own exception there)."""


def _hub() -> Any:
    """The parts of a :class:`~vatra.federated.grpc.hub.Hub` that ``secagg_reply`` touches."""
    events: list[str] = []
    run_dir = SimpleNamespace(log_event=lambda kind, **fields: events.append(kind))
    return SimpleNamespace(
        cond=threading.Condition(), stage_tasks={1: b""}, stage_replies={}, run_dir=run_dir, events=events
    )


def _abort(code: Any, details: str) -> None:
    raise _Refused(details)


_CONTEXT = SimpleNamespace(abort=_abort)


def _secagg_messages() -> list[bytes]:
    rng = np.random.default_rng(0)

    def raw(n: int) -> bytes:
        return rng.integers(0, 256, n, dtype=np.uint8).tobytes()

    keys = BytesTable(np.array([1, 2, 3], np.int64), rng.integers(0, 256, (3, 64), dtype=np.uint8))
    return [
        pack("advertise", 1, {"round": 1, "dim": 10}),
        pack("advertise", 1, {"c_pk": raw(32), "s_pk": raw(32)}),
        pack("share_keys", 1, {"keys": keys, "t": 2, "n1": 3}),
        pack(
            "share_keys",
            1,
            {"ciphertexts": {2: raw(SEALED_BYTES), 3: raw(SEALED_BYTES)}, "b_commit": raw(32)},
        ),
        pack("masked_input", 1, {"y": rng.integers(0, 2**32, 10, dtype=np.uint32), "u3": [1, 2, 3]}),
        pack("unmask", 1, {"b_shares": {2: raw(SHARE_BYTES)}, "s_shares": {3: raw(SHARE_BYTES)}}),
        pack("unmask", 1, {"error": "refused", "nested": {"a": [1, "b", 2.5, None]}}),
    ]


SECAGG_BESIDE = [  # ids, rows of 32 bytes, ids, rows of 33 bytes, a masked vector
    encode(
        {},
        {
            "t0": np.array([1, 2, 3], np.int64),
            "t1": np.zeros((3, 32), np.uint8),
            "t2": np.array([2, 3], np.int64),
            "t3": np.ones((2, 33), np.uint8),
            "t4": np.arange(10, dtype=np.uint32),
        },
    ),
    encode({}),
]


def _secagg_seeds() -> list[bytes]:
    return frame_seeds(_secagg_messages(), SECAGG_BESIDE)


def secagg_one_input(data: bytes) -> None:
    """The secure-aggregation decoder, and the server's handler of a client's reply around it."""
    data = framed(data, SECAGG_BESIDE)
    with contextlib.suppress(WireError):
        unpack(data)
    hub = _hub()
    try:
        secagg_reply(hub, 1, data, _CONTEXT)
    except _Refused:  # INVALID_ARGUMENT: the reply is recorded as a drop-out, with the reason logged
        if hub.events != ["secagg_malformed_reply"] or not isinstance(hub.stage_replies.get(1), str):
            raise AssertionError("a refused reply was not recorded as a drop-out and logged") from None


WIRE = Target("wire", wire_one_input, _wire_seeds, WIRE_TOKENS, _shape_findings)
SECAGG = Target("secagg", secagg_one_input, _secagg_seeds, SECAGG_TOKENS, _shape_findings)
