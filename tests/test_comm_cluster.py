"""The network-namespace test cluster: up, a 2-host training across shaped links, down."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from tests._dist import needs_netns, run_vatra
from tests.conftest import vatra_in_process

from vatra.launch.cluster import Cluster, parse_bandwidth
from vatra.rundir import read_jsonl

# The cluster tests share network-namespace names and the switch address: one xdist worker runs them all.
pytestmark = pytest.mark.xdist_group("netns")


def _namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


@needs_netns
def test_two_host_training_on_the_cluster(tmp_path: Path) -> None:
    name = f"t{os.getpid() % 100000}"
    run_dir = tmp_path / "run"
    up = run_vatra("cluster", "up", "--name", name, "--hosts", "2", "--procs-per-host", "2",
                   "--bandwidth", "200mbit")  # fmt: skip
    try:
        assert up.returncode == 0, up.stderr
        assert {f"{name}-sw", f"{name}-h0", f"{name}-h1"} <= set(_namespaces())
        before = Cluster.load(name).link_bytes()
        run = run_vatra(
            "cluster", "run", "--name", name, "--timeout", "200", "--",
            "vatra", "train", "examples/digits.toml", "--run-dir", str(run_dir),
            "--set", "train.steps=12", "--set", "train.eval_every=0", "--set", "run.progress=off",
            "--set", "run.tensorboard=false", "--set", "model.hidden=[64]",
        )  # fmt: skip
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        after = Cluster.load(name).link_bytes()
    finally:
        down = run_vatra("cluster", "down", "--name", name)
    assert down.returncode == 0, down.stderr
    assert not [n for n in _namespaces() if n.startswith(f"{name}-")]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 4 and summary["steps"] == 12
    # 2 hosts × 2 processes: the hook found the host layout from the elastic agents
    comm = [e for e in read_jsonl(run_dir / "events.jsonl") if e["event"] == "comm"]
    assert comm and all(e["topology"] == "hierarchical" for e in comm)
    # hierarchical: only leaders cross hosts, each sending what it counted for the ring among leaders
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert all(m["comm_bytes"] > 0 for m in metrics)
    for host in (f"{name}-h0", f"{name}-h1"):
        sent = after[host]["tx_bytes"] - before[host]["tx_bytes"]
        assert sent > summary["comm_bytes"] // 2  # gradient bytes crossed the shaped links
    # what rank 0 (host 0's leader) counted as crossing hosts did leave host 0 (headers come on top)
    h0_sent = after[f"{name}-h0"]["tx_bytes"] - before[f"{name}-h0"]["tx_bytes"]
    assert 0 < summary["comm_cross_host_bytes"] <= h0_sent
    assert all(m["comm_cross_host_bytes"] > 0 for m in metrics)


def test_cluster_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse_bandwidth("100mbit") == 100_000_000 and parse_bandwidth("1.5gbit") == 1_500_000_000
    code, _, err = vatra_in_process(capsys, "cluster", "up", "--bandwidth", "fast")
    assert code == 2 and err.startswith("error: --bandwidth 'fast'")
    assert "Traceback" not in err
    code, _, err = vatra_in_process(capsys, "cluster", "up", "--latency-ms", "-5")
    assert code == 2 and err.startswith("error: --latency-ms -5: must be between")
    code, _, err = vatra_in_process(
        capsys, "cluster", "run", "--name", "nosuch", "--", "vatra", "train", "x.toml"
    )
    assert code != 0 and err.count("\n") == 1 and "error:" in err


def _has_netem() -> bool:
    probe = f"vnetem{os.getpid()}"
    if subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode:
        return False
    try:
        cmd = ["tc", "-n", probe, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"]
        return subprocess.run(cmd, capture_output=True).returncode == 0
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)


@needs_netns
def test_latency_is_added_with_netem_or_refused_in_one_line() -> None:
    name = f"l{os.getpid() % 100000}"
    up = run_vatra("cluster", "up", "--name", name, "--hosts", "2", "--latency-ms", "40")
    try:
        if not _has_netem():  # this machine: refused before anything is built, nothing left behind
            assert up.returncode != 0 and up.stderr.count("\n") == 1, up.stderr
            assert up.stderr.startswith("error: --latency-ms 40: this kernel has no netem qdisc")
            assert "only bandwidth is shaped" in up.stderr and "Traceback" not in up.stderr
            assert not [n for n in _namespaces() if n.startswith(f"{name}-")]
            return
        # a kernel with netem: a round trip between two hosts takes twice the one-way latency
        assert up.returncode == 0, up.stderr
        hosts = Cluster.load(name).hosts
        ping = subprocess.run(
            ["ip", "netns", "exec", hosts[0].netns, "ping", "-c", "3", "-q", hosts[1].address],
            capture_output=True,
            text=True,
        )
        rtt_avg = float(ping.stdout.rsplit("=", 1)[1].split("/")[1])
        assert 78 <= rtt_avg <= 200, ping.stdout
    finally:
        run_vatra("cluster", "down", "--name", name)
    assert not [n for n in _namespaces() if n.startswith(f"{name}-")]
