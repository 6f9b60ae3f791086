"""A server no authenticated client can crash or steer: hostile messages, calls and sizes are refused."""

from __future__ import annotations

import contextlib
import json
import struct
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from safetensors.numpy import save
from tests._fl_helpers import start_client, start_server
from tests.conftest import small_config

from vatra.federated import FitIns, FitRes, ParamLayout, UploadHook
from vatra.federated._base import EvalRes
from vatra.federated.certs import ServerCredentials, client_credentials, generate
from vatra.federated.client import initial_weights
from vatra.federated.compression import CompressedUpload
from vatra.federated.data import build_federation
from vatra.federated.grpc import RemoteServer
from vatra.federated.grpc.guard import (
    MIN_MESSAGE,
    PER_CLIENT_RPCS,
    RejectLog,
    TokenAuth,
    max_concurrent_rpcs,
    metadata_client,
    payload_rule,
    receive_limit,
    server_options,
)
from vatra.federated.secagg.messages import unpack
from vatra.federated.wire import (
    MAX_DEPTH,
    WireError,
    check_metrics,
    decode,
    decode_eval_res,
    decode_ins,
    decode_res,
    decode_views,
    encode_eval_res,
    encode_ins,
    encode_res,
    json_depth,
)
from vatra.rundir import read_jsonl

GOOD_METRICS = {"loss_before": 2.3, "loss_after": 1.9, "train_loss": 2.0, "duration_s": 0.1, "model": 0}


def _blob(meta_text: str, tensors: dict[str, np.ndarray] | None = None) -> bytes:
    """A safetensors message whose metadata is exactly ``meta_text`` (what a hostile peer can send)."""
    return save(tensors or {"update": np.zeros(4, np.float32)}, metadata={"meta": meta_text})


def _res_meta(**over: Any) -> dict[str, Any]:
    meta = {"kind": "fit_res", "client_id": 0, "round": 1, "num_samples": 10, "metrics": GOOD_METRICS}
    return {**meta, **over}


# ----------------------------------------------------------------------- wire


def test_a_well_formed_fit_result_and_evaluation_report_decode() -> None:
    res = FitRes(2, 3, 40, np.arange(4, dtype=np.float32), dict(GOOD_METRICS, tags=["a", 1, 2.5]))
    got = decode_res(encode_res(res))
    assert (got.client_id, got.round, got.num_samples, got.metrics) == (2, 3, 40, res.metrics)
    report = decode_eval_res(encode_eval_res(EvalRes(2, 3, 17, {"accuracy": 0.9, "loss": 0.4})))
    assert report.num_examples == 17 and report.metrics == {"accuracy": 0.9, "loss": 0.4}


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_json_constants_are_refused_in_received_messages(constant: str) -> None:
    text = json.dumps(_res_meta()).replace("2.3", constant)
    with pytest.raises(WireError, match=f"constant {constant}"):
        decode_res(_blob(text))
    # A float literal that overflows to inf is not a constant: the metrics check refuses it.
    with pytest.raises(WireError, match="not a finite number"):
        decode_res(_blob(json.dumps(_res_meta()).replace("2.3", "1e400")))
    # The server's own checkpoint may hold ε = Infinity: decode (trusted bytes) accepts it.
    assert decode(_blob(json.dumps({"round": 3, "epsilon": float("inf")})))[0]["epsilon"] == float("inf")


def test_deeply_nested_json_is_refused_before_parsing() -> None:
    deep = "[" * 100_000 + "]" * 100_000  # json.loads would hit the recursion limit
    with pytest.raises(WireError, match=f"deeper than {MAX_DEPTH}"):
        decode_res(_blob(json.dumps(_res_meta(metrics={"x": 1})).replace("1}", f'1, "y": {deep}}}')))
    # In the safetensors header itself (outside the metadata string), too.
    head = json.dumps({"__metadata__": {"meta": "{}"}, "t": {"dtype": "F32", "shape": [], "x": 0}})
    head = head.replace("0}", deep + "}")
    with pytest.raises(WireError, match="deeper"):
        decode_views(struct.pack("<Q", len(head)) + head.encode())
    # Brackets inside strings and escaped quotes do not count.
    assert json_depth(b'{"a": "[[[[\\"[[", "b": [1, {"c": "\\\\"}]}') == 3


@pytest.mark.parametrize(
    ("over", "match"),
    [
        ({"num_samples": 10**400}, "num_samples must be an integer"),
        ({"num_samples": 10**18}, "num_samples must be an integer of at most 2"),
        ({"num_samples": "10"}, "num_samples"),
        ({"num_samples": 10.0}, "num_samples"),
        ({"client_id": True}, "client_id"),
        ({"round": None}, "round"),
        ({"kind": "fit_ins"}, "not a fit result"),
        ({"metrics": [1, 2]}, "metrics must be a JSON object"),
        ({"metrics": {"model": "0"}}, "'model' = '0' must be an integer"),
        ({"metrics": {"loss_after": "low"}}, "'loss_after' = 'low' must be a number"),
        ({"metrics": {"duration_s": True}}, "'duration_s' = True must be a number"),
        ({"metrics": {"note": "x" * 1000}}, "not a finite number, a bool or a short string"),
        ({"metrics": {"nested": {"a": 1}}}, "'nested'"),
        ({"metrics": {"none": None}}, "'none'"),
        ({"metrics": {"big": 10**20}}, "'big'"),
        ({"metrics": {"xs": list(range(65))}}, "a list of at most 64"),
        ({"metrics": {"xs": [[1]]}}, "'xs'"),
        ({"metrics": {f"m{i}": i for i in range(65)}}, "65 metrics"),
        ({"metrics": {"k" * 300: 1}}, "metric name"),
    ],
)
def test_malformed_fit_results_raise_wire_errors_with_a_reason(over: dict[str, Any], match: str) -> None:
    with pytest.raises(WireError, match=match):
        decode_res(_blob(json.dumps(_res_meta(**over))))


def test_check_metrics_accepts_what_clients_send() -> None:
    assert check_metrics(GOOD_METRICS) is None
    assert check_metrics({**GOOD_METRICS, "update_floats": 4810, "dp_unclipped": 1, "ok": True}) is None
    assert check_metrics({"accuracy": 0.5, "name": "x"}, numbers_only=True) == (
        "metric 'name' = 'x' must be a number"
    )


def test_extra_tensors_and_unexpected_payload_names_are_refused() -> None:
    meta = json.dumps(_res_meta())
    update = np.zeros(4, np.float32)
    with pytest.raises(WireError, match="unexpected tensor 'evil'"):
        decode_res(_blob(meta, {"update": update, "evil": np.zeros(2, np.float32)}))
    with_payload = _blob(meta, {"update": update, "payload.0.raw": np.zeros(2, np.float32)})
    assert set(decode_res(with_payload).payload) == {"0.raw"}  # no rule: the hook judges
    with pytest.raises(WireError, match=r"unexpected tensor 'payload\.0\.raw'"):
        decode_res(with_payload, allowed_payload=payload_rule(UploadHook()))


def test_payload_rule_of_the_compression_hook_accepts_exactly_its_names() -> None:
    cfg = small_config(federated={"compression": "topk"})
    layout = ParamLayout(("a", "b"), ((3, 4), (4,)))
    rule = payload_rule(CompressedUpload(cfg, layout))
    assert rule is not None
    assert all(rule(n) for n in ("0.raw", "1.raw", "0.0", "0.1", "1.2.bf16"))
    assert not any(rule(n) for n in ("2.raw", "0.x", "-1.raw", "01.raw", "0.0.fp8", "0.123", "raw"))
    # A round trip through the real hook passes its own rule.
    hook = CompressedUpload(cfg, layout)
    res = hook.encode(FitRes(0, 1, 5, np.arange(16, dtype=np.float32)), FitIns(0, 1, []))
    got = hook.decode(decode_res(encode_res(res), allowed_payload=rule))
    np.testing.assert_array_equal(got.update.size, 16)


def test_a_compressed_update_claiming_a_huge_size_is_refused_before_allocating() -> None:
    # A client may claim any update_floats: the hook checks it against the model before it
    # allocates (2**60 floats would be a MemoryError, or swap, before the old size check ran).
    cfg = small_config(federated={"compression": "topk"})
    hook = CompressedUpload(cfg, ParamLayout(("a", "b"), ((3, 4), (4,))))
    res = hook.encode(FitRes(0, 1, 5, np.arange(16, dtype=np.float32)), FitIns(0, 1, []))
    res.metrics["update_floats"] = 2**60
    with pytest.raises(WireError, match="parameter boundary"):
        hook.decode(res)


def test_malformed_fit_instructions_and_reports_raise_wire_errors() -> None:
    good = encode_ins(FitIns(1, 2, [np.zeros(3, np.float32)], {"local_steps": 2}))
    assert decode_ins(good).config == {"local_steps": 2}
    for meta in (
        {"kind": "fit_ins", "client_id": 1, "round": 2, "config": {}},  # no "models"
        {"kind": "fit_ins", "client_id": 1, "round": 2, "config": [], "models": 1},
        {"kind": "fit_ins", "client_id": 1, "round": 2, "config": {}, "models": 2},  # one tensor missing
        {"kind": "wait"},
    ):
        with pytest.raises(WireError):
            decode_ins(_blob(json.dumps(meta), {"model.0": np.zeros(3, np.float32)}))
    report = {"kind": "eval_res", "client_id": 0, "round": 1, "num_examples": 5}
    for bad in ({"metrics": {"accuracy": "high"}}, {"metrics": {}, "num_examples": -1}, {"metrics": 3}):
        with pytest.raises(WireError, match="evaluation report"):
            decode_eval_res(save({}, metadata={"meta": json.dumps({**report, **bad})}))


def _mutations(blob: bytes, rng: np.random.Generator, count: int) -> Iterator[bytes]:
    """Byte flips, truncations, insertions and header-length lies, mostly inside the header."""
    (n,) = struct.unpack_from("<Q", blob)
    specials = [b"[", b"{", b'"', b"\\", b"NaN", b"-", b"1e999", b"\x00", b"\xff", b"}", b","]
    for _ in range(count):
        data = bytearray(blob)
        kind = rng.integers(5)
        at = int(rng.integers(8, 8 + n))
        if kind == 0:
            data[at] = int(rng.integers(256))
        elif kind == 1:
            data = data[: int(rng.integers(len(data)))]
        elif kind == 2:
            data[at:at] = specials[int(rng.integers(len(specials)))] * int(rng.integers(1, 50))
        elif kind == 3:
            data[:8] = struct.pack(
                "<Q", int(rng.integers(2**63)) if rng.random() < 0.3 else n + int(rng.integers(-9, 9))
            )
        else:
            data[at : at + 8] = bytes(rng.integers(0, 256, 8, dtype=np.uint8))
        yield bytes(data)


def test_fuzzed_messages_raise_only_wire_errors() -> None:
    # Prepare: one valid message of each kind a peer sends or a client reads.
    res = FitRes(
        1, 2, 30, np.arange(6, dtype=np.float32), dict(GOOD_METRICS), {"0.raw": np.ones(3, np.float32)}
    )
    blobs = [
        encode_res(res),
        encode_eval_res(EvalRes(1, 2, 7, {"accuracy": 0.5})),
        encode_ins(FitIns(1, 2, [np.zeros(6, np.float32)], {"local_steps": 3, "mu": 0.0})),
    ]
    readers = (decode_res, decode_eval_res, decode_ins, decode, decode_views, unpack)
    rng = np.random.default_rng(0)
    # Execute + Assert: whatever the bytes, a reader returns or raises WireError, nothing else.
    for blob in blobs:
        for mutated in _mutations(blob, rng, 400):
            for read in readers:
                with contextlib.suppress(WireError):
                    read(mutated)


# ---------------------------------------------------------------------- guard


def test_metadata_client_parses_only_plain_ids() -> None:
    assert metadata_client((("x-vatra-client", "3"), ("x-vatra-token", "t"))) == (3, "t")
    for raw in ("-1", "3.0", " 3", "٣", "99999999999", "", "0x3"):
        assert metadata_client((("x-vatra-client", raw),))[0] == -1
    assert metadata_client(None) == (-1, "")


def test_reject_log_writes_one_event_per_host_per_period_with_the_held_back_count() -> None:
    events: list[dict[str, Any]] = []
    now = [0.0]
    log = RejectLog(
        lambda event, **f: events.append({"event": event, **f}), every_s=10.0, clock=lambda: now[0]
    )
    for port in range(100):  # a token-guessing peer: new connection, new port, each time
        log(f"ipv4:10.0.0.7:{40000 + port}", "wrong token")
    log("ipv4:10.0.0.8:5000", "wrong token")
    assert [(e["peer"], e["suppressed"]) for e in events] == [
        ("ipv4:10.0.0.7:40000", 0),
        ("ipv4:10.0.0.8:5000", 0),
    ]
    now[0] = 10.5
    log("ipv4:10.0.0.7:1", "wrong token")
    assert events[-1]["suppressed"] == 99 and len(events) == 3


def test_receive_limit_is_twice_the_largest_message_with_a_floor() -> None:
    assert receive_limit(4810) == MIN_MESSAGE  # the digits MLP: 19 kB updates
    ten_million = receive_limit(10_000_000)
    assert 80e6 < ten_million < 81e6  # 2 × (40 MB + 64 kB header)
    assert receive_limit(10_000_000, models=3) > 3 * ten_million - 1e6  # clustered: every cluster model
    assert receive_limit(10_000_000, clients=1000) - ten_million == 2 * 1000 * 1024
    assert max_concurrent_rpcs(20) == 20 * PER_CLIENT_RPCS + 16


@pytest.fixture
def guarded(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """A real gRPC server guarded by TokenAuth (1 MiB messages), with one handler that records calls."""
    generate(tmp_path / "certs", 2)
    events: list[dict[str, Any]] = []
    calls: list[int] = []
    release = threading.Event()

    def echo(request: bytes, context: grpc.ServicerContext) -> bytes:
        calls.append(len(request))
        if request == b"block":
            release.wait(30)
        return b"ok"

    auth = TokenAuth(
        ServerCredentials(tmp_path / "certs"), lambda event, **f: events.append({"event": event, **f})
    )
    limit = receive_limit(1000)
    server = grpc.server(
        ThreadPoolExecutor(max_workers=max_concurrent_rpcs(2)),
        interceptors=[auth],
        options=server_options(limit, limit),
        maximum_concurrent_rpcs=max_concurrent_rpcs(2),
    )
    handler = grpc.unary_unary_rpc_method_handler(echo)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.Guarded", {"Echo": handler}),))
    port = server.add_insecure_port("127.0.0.1:0")  # a free port chosen by the OS
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", 64 << 20)])
    tokens = [client_credentials(tmp_path / "certs", c)[1] for c in range(2)]
    try:
        yield {
            "call": channel.unary_unary("/t.Guarded/Echo"),
            "md": [(("x-vatra-client", str(c)), ("x-vatra-token", t)) for c, t in enumerate(tokens)],
            "events": events,
            "calls": calls,
            "release": release,
            "auth": auth,
        }
    finally:
        release.set()
        channel.close()
        server.stop(0)


def _code(fn: Any, *args: Any, **kw: Any) -> grpc.StatusCode:
    try:
        fn(*args, **kw)
    except grpc.RpcError as err:
        return err.code()
    return grpc.StatusCode.OK


def test_unauthenticated_calls_never_reach_the_handler(guarded: dict[str, Any]) -> None:
    call, md = guarded["call"], guarded["md"]
    bad = [
        (),
        (("x-vatra-client", "0"), ("x-vatra-token", "guess")),
        (("x-vatra-client", "1"), md[0][1]),  # client 0's token under client 1's id
        (("x-vatra-client", "7"), ("x-vatra-token", "guess")),
        (("x-vatra-client", "zero"), ("x-vatra-token", "guess")),
    ]
    for metadata in bad:
        assert _code(call, b"hello", metadata=metadata, timeout=10) == grpc.StatusCode.UNAUTHENTICATED
    assert guarded["calls"] == []
    assert len([e for e in guarded["events"] if e["event"] == "rejected"]) == 1  # one host: rate-limited
    assert call(b"hello", metadata=md[0], timeout=10) == b"ok" and guarded["calls"] == [5]


def test_an_oversized_message_is_refused_before_any_handler_and_the_server_stays_up(
    guarded: dict[str, Any],
) -> None:
    call, md = guarded["call"], guarded["md"]
    huge = bytes(2 * MIN_MESSAGE)  # twice the 1 MiB limit
    no_token = (("x-vatra-client", "0"), ("x-vatra-token", "guess"))
    # Without a token the body is never awaited (UNAUTHENTICATED); with one, gRPC refuses it unread.
    assert _code(call, huge, metadata=no_token, timeout=10) == grpc.StatusCode.UNAUTHENTICATED
    assert _code(call, huge, metadata=md[0], timeout=10) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert guarded["calls"] == []
    # A tighter limit once the model is known: refused before the handler, authenticated or not.
    guarded["auth"].request_limit = 1000
    assert _code(call, bytes(2000), metadata=md[0], timeout=10) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert guarded["calls"] == []
    assert call(b"x" * 1000, metadata=md[0], timeout=10) == b"ok"  # still serving


def test_one_client_cannot_take_every_server_thread(guarded: dict[str, Any]) -> None:
    call, md = guarded["call"], guarded["md"]
    # Execute: client 0 parks its share of calls in a blocking handler.
    parked = [call.future(b"block", metadata=md[0], timeout=30) for _ in range(PER_CLIENT_RPCS)]
    deadline = time.monotonic() + 20
    while len(guarded["calls"]) < PER_CLIENT_RPCS:
        assert time.monotonic() < deadline, "the parked calls never reached the handler"
        time.sleep(0.05)
    # Assert: its next call is refused at once, client 1 is still served.
    assert _code(call, b"more", metadata=md[0], timeout=10) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert call(b"hello", metadata=md[1], timeout=10) == b"ok"
    guarded["release"].set()
    assert [f.result() for f in parked] == [b"ok"] * PER_CLIENT_RPCS
    assert call(b"again", metadata=md[0], timeout=10) == b"ok"  # its share is free again


# ------------------------------------------------------------------ deployment


def test_deployed_server_rate_limits_rejections_and_refuses_oversized_calls(tmp_path: Path) -> None:
    # Prepare: a two-client deployment whose model is known from the start (server eval data).
    cfg = small_config(
        federated={"clients": 2, "rounds": 1, "local_steps": 2, "min_clients": 2}, monitor={"report": False}
    )
    generate(tmp_path / "certs", 2)
    fed = build_federation(cfg)
    server, address = start_server(
        cfg, tmp_path / "certs", tmp_path / "run", eval_data=fed.server_val, spec=fed.spec
    )
    ca, _ = client_credentials(tmp_path / "certs", 0)
    guesser = RemoteServer(address, ca, 0, "guess")
    # Execute: a token-guessing peer, then an oversized unauthenticated upload.
    codes = [_code(guesser.call, "Join", timeout=30) for _ in range(20)]
    size = receive_limit(initial_weights(cfg, fed.spec)[1].size) + 1
    oversized = _code(guesser.call, "Submit", bytes(size), timeout=60)
    guesser.close()
    # The federation still runs to the end with the real clients.
    clients = [start_client(cfg, address, c, tmp_path / "certs", data=fed.client_data(c)) for c in range(2)]
    server.join_result(120)
    assert [c.join_result(30) for c in clients] == [1, 1]
    # Assert
    assert codes == [grpc.StatusCode.UNAUTHENTICATED] * 20
    assert oversized == grpc.StatusCode.UNAUTHENTICATED  # refused without awaiting its body
    rejected = [e for e in read_jsonl(tmp_path / "run" / "events.jsonl") if e["event"] == "rejected"]
    assert len(rejected) == 1 and rejected[0]["suppressed"] == 0  # 19 held back within 10 s


@pytest.mark.parametrize("value", [1e300, -0.5, 1.0000001])
def test_an_evaluation_report_with_a_share_outside_0_1_is_refused(value: float) -> None:
    from vatra.federated import EvalRes
    from vatra.federated.wire import decode_eval_res, encode_eval_res

    assert decode_eval_res(encode_eval_res(EvalRes(0, 1, 10, {"accuracy": 0.5, "loss": 3.0}))).metrics
    with pytest.raises(WireError, match="outside"):
        decode_eval_res(encode_eval_res(EvalRes(0, 1, 10, {"accuracy": value})))
    with pytest.raises(WireError, match="outside"):
        decode_eval_res(encode_eval_res(EvalRes(0, 1, 10, {"ndcg@10": value})))
