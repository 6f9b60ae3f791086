"""Cross-device scale: sampled evaluation, clients that cost nothing until selected, array selectors."""

from __future__ import annotations

import resource
import time
from pathlib import Path

import numpy as np
import pytest
from tests._fl_helpers import READ
from tests.conftest import small_config

from vatra.config import PartitionConfig
from vatra.errors import ConfigError
from vatra.federated._base import FitIns
from vatra.federated.adaptive import AdaptiveSelector
from vatra.federated.checkpoint import server_state
from vatra.federated.client import LocalClient
from vatra.federated.data import build_federation, client_shards, hold_out
from vatra.federated.owned import build_owners
from vatra.federated.population import owner_shards
from vatra.federated.selection import evaluation_count, evaluation_sample
from vatra.federated.simulation import simulate
from vatra.federated.wire import decode
from vatra.rundir import RunDir, read_jsonl


@pytest.mark.parametrize(
    ("method", "clients", "extra"),
    [
        ("iid", 37, {}),
        ("iid", 50, {"size_skew": 1.5}),
        ("dirichlet", 40, {"alpha": 0.5}),
        ("dirichlet", 300, {"alpha": 0.05}),  # tiny alpha: many empty clients filled from the largest
        ("dirichlet", 900, {"alpha": 0.1}),  # gifts reach clients of one row: the sequential rule
        ("label_skew", 23, {"classes_per_client": 3}),
    ],
)
def test_the_vectorised_partition_is_the_eager_one(method: str, clients: int, extra: dict) -> None:
    # Prepare
    labels = np.random.default_rng(7).integers(0, 10, 1000)
    p = PartitionConfig(method=method, **extra)  # type: ignore[arg-type]
    # Execute
    eager = client_shards(1000, labels, clients, p, seed=3)
    lazy = owner_shards(1000, labels, clients, p, seed=3)
    # Assert: the same rows, client for client
    assert lazy.clients == clients
    assert all(np.array_equal(lazy.rows(c), eager[c]) for c in range(clients))


def test_a_lazy_client_holds_the_rows_of_the_eager_partition() -> None:
    cfg = small_config(federated={"clients": 60, "partition": {"method": "dirichlet", "alpha": 0.3}})
    fed = build_federation(cfg)
    labels = fed.train.labels
    eager = client_shards(len(fed.train), labels, 60, cfg.federated.partition, cfg.run.seed)
    for c in (0, 17, 59):
        data = fed.client_data(c)
        train, val = hold_out(eager[c], cfg.federated.val_fraction, cfg.run.seed, c)
        assert np.array_equal(data.train_rows, train) and np.array_equal(data.val_rows, val)
    assert np.array_equal(fed.sizes, [len(hold_out(s, 0.2, cfg.run.seed, c)[0]) for c, s in enumerate(eager)])


def test_evaluation_samples_a_count_or_a_fraction() -> None:
    assert evaluation_count(100, 60) == 60 and evaluation_count(100, 10_000) == 100
    assert evaluation_count(0.1, 10_000) == 1000 and evaluation_count(0.001, 10) == 1
    with pytest.raises(ConfigError, match="fraction must lie in"):
        small_config(federated={"evaluate_clients": 2.5})


def test_a_round_evaluates_a_seeded_sample_of_the_clients(tmp_path: Path) -> None:
    cfg = small_config(
        monitor={"report": False},
        federated={
            "clients": 40,
            "clients_per_round": 5,
            "rounds": 2,
            "local_steps": 1,
            "evaluate_clients": 7,
        },
    )
    simulate(cfg, RunDir(tmp_path), progress=False)
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert all(r["evaluate_asked"] == 7 and 1 <= r["evaluated_clients"] <= 7 for r in rows)
    first, again, second = (evaluation_sample(0, r, list(range(40)), 7) for r in (1, 1, 2))
    assert first == again != second and len(set(first)) == 7  # seeded per round, without replacement


@pytest.mark.slow(12)
def test_a_hundred_thousand_clients_run_two_rounds_in_bounded_memory(tmp_path: Path) -> None:
    # Prepare: 100,000 registered clients of 2-3 rows each, 50 trained per round
    cfg = small_config(
        monitor={"report": False},
        data={"name": "synthetic", "samples": 300_000, "n_features": 16, "informative": 8},
        federated={
            "clients": 100_000,
            "clients_per_round": 50,
            "rounds": 2,
            "local_steps": 2,
            "partition": {"method": "iid"},
        },
    )
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    t0 = time.perf_counter()
    # Execute
    summary = simulate(cfg, RunDir(tmp_path), progress=False)
    # Assert
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert [len(r["selected"]) for r in rows] == [50, 50] and summary["rounds"] == 2
    assert all(r["evaluate_asked"] == 100 for r in rows)
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mb < 400, f"peak memory grew {grown_mb:.0f} MB"
    assert time.perf_counter() - t0 < 60


def test_adaptive_selection_of_a_thousand_from_a_million_is_array_work() -> None:
    cfg = small_config(federated={"clients": 1_000_000, "selection": "adaptive"}).federated
    sel = AdaptiveSelector(cfg, seed=0)
    assert all(isinstance(v, np.ndarray) for v in vars(sel).values() if not isinstance(v, int | type(cfg)))
    rng = np.random.default_rng(0)
    tried = rng.choice(1_000_000, 200_000, replace=False)  # half-way through a long run
    sel.stat[tried] = rng.random(len(tried))
    sel.duration[tried] = rng.random(len(tried))
    sel.last_round[tried] = rng.integers(1, 50, len(tried))
    available = np.arange(1_000_000)
    t0 = time.perf_counter()
    picked = sel.select(60, available, 1000)
    assert time.perf_counter() - t0 < 0.5  # a per-client Python loop over a million takes seconds
    assert len(set(picked)) == 1000


def test_adaptive_state_is_checkpointed_as_arrays_and_resumes(tmp_path: Path) -> None:
    # Prepare: 2 rounds, then the same run folder asked for 3 (resumes at round 3)
    fed = {"clients": 12, "clients_per_round": 4, "local_steps": 1, "selection": "adaptive"} | {
        "step_time_s": 0.01,  # modelled durations: the same in both runs
        "speed_sigma": 1.0,
    }
    cfg = small_config(monitor={"report": False}, federated={**fed, "rounds": 3})
    simulate(cfg, RunDir(tmp_path / "whole"), progress=False)
    short = small_config(monitor={"report": False}, federated={**fed, "rounds": 2})
    simulate(short, RunDir(tmp_path / "resumed"), progress=False)
    # Execute
    simulate(cfg, RunDir(tmp_path / "resumed"), progress=False)
    # Assert: the resumed run picks the same clients in round 3 as the uninterrupted one
    whole, resumed = (read_jsonl(tmp_path / d / "metrics.jsonl") for d in ("whole", "resumed"))
    assert resumed[-1]["round"] == 3 and resumed[-1]["selected"] == whole[-1]["selected"]
    meta, tensors = decode(server_state(RunDir(tmp_path / "whole")))
    assert tensors["selector.stat"].shape == (12,) and "stat" not in meta["selector"]
    sel = AdaptiveSelector(cfg.federated, seed=0)
    old = {"stat": [None, 2.0] + [None] * 10, "duration": [None] * 12, "last_round": [0] * 12}
    sel.load_state(old | {"failures": [0] * 12})
    assert np.isnan(sel.stat[0]) and sel.stat[1] == 2.0  # an older checkpoint's JSON lists still load


@pytest.mark.parametrize(
    "optim", [{"momentum": 0.9, "weight_decay": 1e-3}, {"momentum": 0.0, "schedule": "cosine"}]
)
def test_vmapped_clients_give_the_updates_of_clients_trained_one_by_one(optim: dict) -> None:
    # Prepare: 12 clients of one round, the same weights sent to each
    cfg = small_config(
        optim={"name": "sgd", "lr": 0.05, **optim}, federated={"clients": 12, "local_steps": 4}
    )
    fed = build_federation(cfg)
    client = LocalClient(cfg, fed.spec, fed.client_data)
    conf = {"local_steps": 4, "local_epochs": 0, "mu": 0.0}
    group = [FitIns(c, 1, [client.init], conf) for c in range(12)]
    # Execute
    one_by_one = [client.fit(ins)[0] for ins in group]
    together = client.fit_group(group)
    # Assert: float32 sums in another order: within 1e-5 of updates of size ~0.1
    assert together is not None
    for a, b in zip(one_by_one, together, strict=True):
        assert a.client_id == b.client_id and a.num_samples == b.num_samples
        np.testing.assert_allclose(b.update, a.update, atol=1e-5, rtol=0)
        assert b.metrics["train_loss"] == pytest.approx(a.metrics["train_loss"], abs=1e-5)
    assert np.abs(together[0].update).max() > 1e-3  # they trained


def test_a_config_the_vmap_cannot_express_trains_one_by_one() -> None:
    cfg = small_config(federated={"clients": 4, "strategy": "fedprox", "mu": 0.1})
    fed = build_federation(cfg)
    client = LocalClient(cfg, fed.spec, fed.client_data)
    conf = {"local_steps": 2, "local_epochs": 0, "mu": 0.1}
    assert client.fit_group([FitIns(c, 1, [client.init], conf) for c in range(4)]) is None


def test_a_factory_reads_only_the_clients_that_are_selected(tmp_path: Path) -> None:
    # Prepare
    READ.clear()
    fed = {"clients": 5000, "clients_per_round": 4, "rounds": 2, "local_steps": 2, "evaluate_clients": 3}
    source = {"client_data": "tests._fl_helpers:owner_rows"}
    cfg = small_config(monitor={"report": False}, federated=fed | source)
    # Execute
    simulate(cfg, RunDir(tmp_path), progress=False)
    # Assert: only the 2 × 4 trainers and 2 × 3 evaluators were read; all of them reported
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    assert len(READ) == 2 * (4 + 3)
    assert {c for r in rows for c in r["selected"]} <= set(READ)
    assert all(r["evaluated_clients"] == 3 and r["evaluated_examples"] == 36 for r in rows)
    assert not (tmp_path / "partition.json").exists()


def test_a_folder_holds_one_file_per_owner(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    (tmp_path / "owners").mkdir()
    for c in range(3):
        np.savez(tmp_path / "owners" / f"site{c}.npz", x=rng.random((30, 64)), y=rng.integers(0, 10, 30))
    data = {"name": "npz", "path": str(tmp_path / "owners" / "site0.npz")}
    fed = {"clients": 3, "rounds": 1, "local_steps": 1, "client_data": str(tmp_path / "owners")}
    simulate(
        small_config(monitor={"report": False}, data=data, federated=fed),
        RunDir(tmp_path / "r"),
        progress=False,
    )
    assert read_jsonl(tmp_path / "r" / "metrics.jsonl")[0]["evaluated_clients"] == 3
    wrong = small_config(data=data, federated={**fed, "clients": 4})
    with pytest.raises(ConfigError, match=r"holds 3 files but federated.clients = 4"):
        build_owners(wrong)


def test_a_vmapped_run_ends_with_the_weights_of_the_per_client_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The process pool (workers > 1) trains client by client: a seed must give the same model.
    cfg = small_config(
        monitor={"report": False},
        optim={"name": "sgd", "lr": 0.05, "momentum": 0.9},
        federated={"clients": 10, "clients_per_round": 6, "rounds": 2, "local_steps": 3},
    )
    together = simulate(cfg, RunDir(tmp_path / "vmap"), progress=False)
    monkeypatch.setattr(LocalClient, "fit_group", lambda self, group: None)
    one_by_one = simulate(cfg, RunDir(tmp_path / "loop"), progress=False)
    assert together["weights_sha256"] == one_by_one["weights_sha256"]
