"""Cloud-edge federated sync: int8 downloads and uploads, per-client error feedback, device profiles."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tests._fl_helpers import start_client, start_server
from tests.conftest import small_config

from vatra.cli import main
from vatra.compress import is_prepared
from vatra.compress.qat4 import is_int4w_prepared
from vatra.config import Config
from vatra.errors import ConfigError, VatraError
from vatra.federated import FitIns, FitRes
from vatra.federated.certs import generate
from vatra.federated.client import LocalClient
from vatra.federated.compression import build_upload_hook
from vatra.federated.data import build_federation
from vatra.federated.edgesync import EdgeSync, Int8Download, int8_bytes, pack_int8
from vatra.federated.params import ParamLayout
from vatra.federated.simulation import simulate
from vatra.federated.wire import WireError, decode_ins, decode_res, encode, encode_ins, encode_res
from vatra.rundir import RunDir, read_jsonl

EDGE = {"download": "int8", "error_feedback": True}


def _cfg(edge: dict[str, Any] | None = None, compression: str = "none", qat: str = "none") -> Config:
    return small_config(
        model={"name": "mlp", "hidden": [128]},
        train={"batch_size": 16},
        optim={"name": "sgd", "lr": 0.1, "momentum": 0.9},
        comm={"min_numel": 256},
        monitor={"report": False},  # the 10-class head's bias travels raw, the matrices in int8
        edge={"qat": qat},
        federated={
            "clients": 4,
            "rounds": 3,
            "local_steps": 10,
            "compression": compression,
            "edge": edge or {},
            "partition": {"method": "iid"},
        },
    )


def _run(cfg: Config, path: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    summary = simulate(cfg, RunDir(path), progress=False)
    return read_jsonl(path / "metrics.jsonl"), summary


def test_edge_round_trip_is_four_times_smaller_both_ways_and_as_accurate(tmp_path: Path) -> None:
    # Prepare: full-precision FL, then the edge run: int8 uploads with error feedback, int8 downloads, QAT
    full, _ = _run(_cfg(), tmp_path / "fp32")
    edge, _ = _run(_cfg(EDGE, compression="int8", qat="int8"), tmp_path / "edge")
    # Assert: every round's messages ~4x smaller each way (1 byte a weight + 4 a row + the headers)
    for f, e in zip(full, edge, strict=True):
        assert f["bytes_down"] / e["bytes_down"] > 3.4
        assert f["bytes_up"] / e["bytes_up"] > 3.4
    # the tiny run ends where full precision does (digits, 3 rounds: ~0.79; int8 noise is far smaller)
    assert edge[-1]["global_accuracy"] == pytest.approx(full[-1]["global_accuracy"], abs=0.03)
    assert edge[-1]["global_accuracy"] > 0.7
    assert edge[-1]["client_loss"] != full[-1]["client_loss"]  # not the same run: int8 changed the weights


def test_error_feedback_keeps_each_clients_residual_for_its_next_upload() -> None:
    # Prepare: an int8 upload hook with error feedback; two clients upload different updates
    cfg = _cfg(EDGE, compression="int8")
    layout = ParamLayout(("w", "b"), ((32, 16), (300,)))  # b: over min_numel, quantized as one row
    hook = build_upload_hook(cfg, layout)
    rng = np.random.default_rng(0)
    updates = {c: rng.standard_normal(layout.size).astype(np.float32) for c in (0, 1)}

    def upload(cid: int, rnd: int, update: np.ndarray) -> np.ndarray:
        sent = hook.encode(FitRes(cid, rnd, 5, update.copy()), FitIns(cid, rnd, []))
        return hook.decode(decode_res(encode_res(sent))).update

    # Execute: round 1 for both, then a zero update from client 0
    got = {c: upload(c, 1, u) for c, u in updates.items()}
    residual_0 = {k: v.clone() for k, v in hook.memory.residuals.items() if k[0] == 0}
    again = upload(0, 2, np.zeros(layout.size, np.float32))
    # Assert: one residual per client and tensor; client 0's second upload carries its own leftover
    assert sorted(hook.memory.residuals) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    leftover = np.concatenate([residual_0[(0, 0)].reshape(-1), residual_0[(0, 1)].reshape(-1)])
    assert np.abs(leftover).max() > 0  # int8 rounding dropped something
    np.testing.assert_allclose(again, leftover, atol=np.abs(leftover).max() / 127)
    # what reached the server plus what is still held adds up to what client 0 trained
    held = np.concatenate(
        [t.reshape(-1).numpy() for k, t in sorted(hook.memory.residuals.items()) if k[0] == 0]
    )
    np.testing.assert_allclose(got[0] + again + held, updates[0], atol=1e-5)


def test_device_profile_decides_what_each_client_is_sent() -> None:
    # Prepare: a laptop, and a device that holds the int8 model but not the fp32 one
    fp32_mb = 4 * (64 * 128 + 128 + 128 * 10 + 10) / 1e6
    small = {"max_model_mb": fp32_mb * 0.5, "speed": 0.25}
    cfg = _cfg({"profiles": ["laptop", "watch"], "device_profiles": {"watch": small}})
    fed = build_federation(cfg)
    client = LocalClient(cfg, fed.spec, fed.client_data)
    sync = EdgeSync(cfg, client.layout.shapes)
    ins = FitIns(1, 1, [client.init])
    # Execute / Assert: clients 0 and 2 get fp32, 1 and 3 the int8 model (a quarter of the bytes)
    assert [sync.form(c) for c in range(4)] == ["fp32", "int8", "fp32", "int8"]
    assert sync.int8_bytes == int8_bytes(client.layout.shapes) < 0.28 * sync.fp32_bytes
    fp32_blob, int8_blob = encode_ins(ins, sync.download(0)), encode_ins(ins, sync.download(1))
    assert len(int8_blob) < 0.3 * len(fp32_blob)
    sent = decode_ins(int8_blob).models[0]  # what the watch trains from: within half an int8 step
    w = client.init[: 64 * 128].reshape(128, 64)
    step = np.abs(w).max(axis=1, keepdims=True) / 127
    assert (np.abs(sent[: 64 * 128].reshape(128, 64) - w) <= step / 2 + 1e-7).all()
    np.testing.assert_array_equal(sent[64 * 128 : 64 * 128 + 128], client.init[64 * 128 : 64 * 128 + 128])
    # a join's profile name is checked before it is used or echoed
    assert (
        sync.declare(5, "x" * 10_000)
        == sync.declare(5, ["watch"])
        == ("device_profile must be a profile name of at most 64 characters")
    )
    assert "not in the server's config" in str(sync.declare(5, "toaster"))
    assert sync.declare(5, "watch") is None and sync.form(5) == "int8"
    # the watch trains four times slower than its log-normal draw (speed 0.25)
    assert client.speeds[1] == pytest.approx(4.0) and client.speeds[0] == pytest.approx(1.0)


def test_a_device_that_cannot_hold_even_the_int8_model_is_refused_in_one_line(
    tmp_path: Path, root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = _cfg({"profiles": ["watch"], "device_profiles": {"watch": {"max_model_mb": 0.001}}})
    fed = build_federation(cfg)
    with pytest.raises(
        ConfigError, match=r"'watch' holds 0.001 MB, but the model is 0.0384 MB in fp32 and 0.0106 MB in int8"
    ):
        EdgeSync(cfg, LocalClient(cfg, fed.spec, fed.client_data).layout.shapes).check_simulated(4)
    # the command: one error line naming both sizes, exit 2, no traceback
    toml = tmp_path / "edge.toml"
    toml.write_text(
        (root / "examples" / "fl_digits.toml").read_text()
        + '\n[federated.edge]\nprofiles = ["watch"]\ndevice_profiles = {watch = {max_model_mb = 0.001}}\n'
    )
    with pytest.raises(SystemExit) as exit_info:
        main(["federate", str(toml), "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err
    assert err.startswith("error: client 0's device profile 'watch' holds 0.001 MB") and "MB in int8" in err


def test_qat_edge_clients_train_fake_quantized_and_a_bad_int8_download_is_a_wire_error() -> None:
    cfg = _cfg(qat="int8")
    fed = build_federation(cfg)
    client = LocalClient(cfg, fed.spec, fed.client_data)
    assert is_prepared(client.model)
    assert client.fit_group([FitIns(0, 1, [client.init]), FitIns(1, 1, [client.init])]) is None  # the loop
    blob = encode_ins(FitIns(0, 1, [client.init]), Int8Download(client.layout.shapes))
    assert len(decode_ins(blob).models[0]) == client.layout.size
    meta = {"kind": "fit_ins", "client_id": 0, "round": 1, "config": {}, "models": 1, "int8_chunks": 4}
    packed = pack_int8(client.init, Int8Download(client.layout.shapes), "model.0")
    short = {**packed, "model.0.0.s": packed["model.0.0.s"][:5]}  # 5 scales for 128 rows
    missing = {k: v for k, v in packed.items() if k != "model.0.2.q"}
    for tensors in (short, missing):
        with pytest.raises(WireError, match="incomplete"):
            decode_ins(encode(meta, tensors))
    with pytest.raises(ConfigError, match="workers = 1"):
        small_config(federated={"workers": 2, "edge": {"error_feedback": True}})


def test_int4w_qat_edge_clients_train_torchaos_fake_quantized_layers(tmp_path: Path) -> None:
    cfg = _cfg(qat="int4w")
    fed = build_federation(cfg)
    client = LocalClient(cfg, fed.spec, fed.client_data)
    assert is_int4w_prepared(client.model) and not is_prepared(client.model)  # not the int8 rounding
    assert client.fit_group([FitIns(0, 1, [client.init]), FitIns(1, 1, [client.init])]) is None  # the loop
    qat, _ = _run(cfg, tmp_path / "int4w")
    full, _ = _run(_cfg(), tmp_path / "fp32")
    assert len(qat) == 3 and qat[-1]["global_accuracy"] > 0.6  # it learns (full precision: ~0.79)
    assert qat[-1]["client_loss"] != full[-1]["client_loss"]  # int4 rounding changed the training


def test_a_deployed_client_declares_its_device_and_gets_what_its_simulated_twin_gets(tmp_path: Path) -> None:
    # Prepare: client 1 runs on a watch that holds the int8 model, not the fp32 one; the simulation
    # gives client 1 the same profile through federated.edge.profiles
    watch = {"watch": {"max_model_mb": 0.005}, "tiny": {"max_model_mb": 0.001}}
    fed_cfg = {"clients": 2, "rounds": 2, "local_steps": 3, "min_clients": 2, "evaluate_every": 0}
    cfg = small_config(federated={**fed_cfg, "edge": {"device_profiles": watch}}, monitor={"report": False})
    twin = small_config(
        federated={**fed_cfg, "edge": {"device_profiles": watch, "profiles": ["laptop", "watch"]}},
        monitor={"report": False},
    )
    plain = simulate(cfg, RunDir(tmp_path / "plain"), progress=False)
    simulated = simulate(twin, RunDir(tmp_path / "sim"), progress=False)
    generate(tmp_path / "certs", 2)
    fed = build_federation(cfg)
    server, address = start_server(cfg, tmp_path / "certs", tmp_path / "deploy", eval_data=fed.server_val)
    # Execute: a device too small for either form is refused at its join, in one line with the sizes
    with pytest.raises(
        VatraError, match=r"client 1: .*'tiny' holds 0.001 MB, but the model is 0.0\d+ MB in fp32"
    ):
        start_client(
            cfg, address, 1, tmp_path / "certs", data=fed.client_data(1), device_profile="tiny"
        ).join_result(60)
    # client 1 joins a second after client 0: its refused join above must not have counted it as
    # present, or round 1 starts with client 0 and sends client 1 the fp32 model before it declares
    certs = tmp_path / "certs"
    clients = [start_client(cfg, address, 0, certs, data=fed.client_data(0))]
    time.sleep(1.0)
    clients.append(start_client(cfg, address, 1, certs, data=fed.client_data(1), device_profile="watch"))
    deployed = server.join_result(120)
    # Assert: the deployment trains what its simulated twin trains, and not what fp32 everywhere gives
    assert [c.join_result(30) for c in clients] == [2, 2]
    assert deployed["weights_sha256"] == simulated["weights_sha256"] != plain["weights_sha256"]
    down = [r["bytes_down"] for r in read_jsonl(tmp_path / "deploy" / "metrics.jsonl")]
    plain_down = [r["bytes_down"] for r in read_jsonl(tmp_path / "plain" / "metrics.jsonl")]
    assert all(d < 0.7 * p for d, p in zip(down, plain_down, strict=True))  # one of two sent int8


def test_a_pruned_int8_download_sends_only_the_kept_weights() -> None:
    # Prepare: the model's weights, sent dense int8 and with half of the matrices' weights cut
    cfg = _cfg({"download": "int8", "download_sparsity": 0.5})
    fed = build_federation(cfg)
    client = LocalClient(cfg, fed.spec, fed.client_data)
    sync = EdgeSync(cfg, client.layout.shapes)
    ins = FitIns(0, 1, [client.init])
    dense_form, pruned_form = Int8Download(client.layout.shapes), sync.download(0)
    assert pruned_form == Int8Download(client.layout.shapes, 0.5)
    # Execute
    dense, pruned = (
        decode_ins(encode_ins(ins, dense_form)).models[0],
        decode_ins(encode_ins(ins, pruned_form)).models[0],
    )
    # Assert: half the matrix weights arrive as 0, the rest as the dense int8 download has them;
    # a bitmask (1/8 byte a weight) and half the int8 values: 0.625 of the dense payload's weight bytes
    matrix = np.ones(client.layout.size, dtype=bool)  # (P,): the two matrices, not the biases
    matrix[64 * 128 : 64 * 128 + 128] = matrix[-10:] = False
    cut = matrix & (pruned == 0)
    assert int(cut.sum()) == int(matrix.sum()) // 2
    np.testing.assert_array_equal(pruned[~cut], dense[~cut])
    assert np.abs(client.init[cut]).max() <= np.abs(client.init[matrix & ~cut]).min()  # the smallest cut
    assert len(encode_ins(ins, pruned_form)) < 0.75 * len(encode_ins(ins, dense_form))  # headers, biases
    assert sync.int8_bytes == int8_bytes(client.layout.shapes, 0.5) < 0.7 * int8_bytes(client.layout.shapes)
    # a bitmask that keeps more weights than values came is a wire error
    meta = {"kind": "fit_ins", "client_id": 0, "round": 1, "config": {}, "models": 1, "int8_chunks": 4}
    packed = pack_int8(client.init, pruned_form, "model.0")
    with pytest.raises(WireError, match="incomplete"):
        decode_ins(encode(meta, {**packed, "model.0.0.v": packed["model.0.0.v"][:-1]}))
