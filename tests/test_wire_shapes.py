"""Tensor shapes a hostile peer can write into a message header: refused as WireError, never ValueError."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from tests.conftest import small_config
from tests.fuzz.wire_targets import tensor_message

from vatra.federated import UploadHook
from vatra.federated._base import FitRes
from vatra.federated.grpc.guard import CLIENT_KEY, TOKEN_KEY
from vatra.federated.grpc.hub import Hub
from vatra.federated.secagg.messages import pack, unpack
from vatra.federated.wire import WireError, decode, decode_eval_res, decode_res, decode_views, encode_res
from vatra.rundir import RunDir, read_jsonl

READERS: list[Callable[[bytes], Any]] = [decode, decode_views, decode_res, decode_eval_res, unpack]


@pytest.mark.parametrize(
    ("shape", "data"),
    [
        ([1] * 65, b"\0" * 4),  # more dimensions than numpy holds
        ([0, 2**63], b""),  # zero-size, one dimension past int64
        ([0, 2**62, 2**62], b""),  # zero-size, in range each, too big together
    ],
    ids=["65-dims", "zero-size-2^63", "zero-size-too-big"],
)
@pytest.mark.parametrize("read", READERS, ids=lambda f: f.__name__)
def test_a_malformed_tensor_shape_raises_wire_error(
    read: Callable[[bytes], Any], shape: list[int], data: bytes
) -> None:
    kind = {"decode_eval_res": "eval_res", "unpack": "secagg"}.get(read.__name__, "fit_res")
    with pytest.raises(WireError):  # a plain ValueError escapes Hub.submit's handler: the round then waits
        read(tensor_message(kind, shape, data))


def test_well_formed_shapes_still_decode() -> None:
    res = FitRes(1, 2, 3, np.arange(4, dtype=np.float32))
    assert decode_res(encode_res(res)).update.tolist() == [0.0, 1.0, 2.0, 3.0]
    _, tensors = decode_views(tensor_message("fit_res", [0, 5], b""))
    assert tensors["update"].shape == (0, 5)
    _, _, body = unpack(pack("advertise", 1, {"w": np.ones((2, 3), np.float32)}))
    assert body["w"].shape == (2, 3)


class _Aborted(Exception):
    pass


def _abort(code: Any, details: str) -> None:
    raise _Aborted(f"{code.name}: {details}")


@pytest.mark.parametrize("shape", [[1] * 65, [0, 2**63]], ids=["65-dims", "zero-size-2^63"])
def test_the_server_drops_a_fit_result_with_a_malformed_shape_and_logs_why(
    tmp_path: Path, shape: list[int]
) -> None:
    # Prepare: a hub in round 1 with a task for client 1 (credentials stubbed: every token passes).
    creds: Any = SimpleNamespace(check=lambda cid, token: True)
    hub = Hub(small_config(), creds, RunDir(tmp_path).create(), UploadHook())
    hub.round, hub.tasks, hub.expected = 1, {1: b"task"}, 6
    context = SimpleNamespace(invocation_metadata=lambda: ((CLIENT_KEY, "1"), (TOKEN_KEY, "t")), abort=_abort)
    # Execute: the client's upload is a tensor numpy cannot hold.
    with pytest.raises(_Aborted, match="INVALID_ARGUMENT"):
        hub.submit(tensor_message("fit_res", shape, b"\0" * 4 if shape[0] else b""), context)
    # Assert: the client is closed for the round, with the reason logged (the round need not wait for it).
    assert hub.failures[1].startswith("rejected: tensor 'update'")
    events = [e for e in read_jsonl(tmp_path / "events.jsonl") if e["event"] == "update_rejected"]
    assert len(events) == 1 and "dimensions" in events[0]["reason"]
