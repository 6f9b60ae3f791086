"""Strategies, selectors, partitions and the wire format, in one process against hand-computed references."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from tests.conftest import small_config

from vatra.config import config_from_dict
from vatra.data import ShardSampler
from vatra.engine import seed_everything
from vatra.errors import ConfigError
from vatra.federated import (
    AdaptiveSelector,
    Clustered,
    FedAdam,
    FedAvg,
    FedYogi,
    FitRes,
    ParamLayout,
    Personalized,
    RandomSelector,
    build_strategy,
)
from vatra.federated.client import LocalClient, ProximalTerm, client_seed
from vatra.federated.data import build_federation, client_shards
from vatra.federated.wire import WireError, check_update, decode_res, encode_res
from vatra.losses import CrossEntropy
from vatra.models import build_model


def _fed_config(**federated: object):
    return small_config(
        federated={"workers": 1, **federated}, optim={"name": "sgd", "lr": 0.1, "momentum": 0.0}
    )


def test_fedavg_one_client_one_step_equals_centralized_sgd() -> None:
    # Prepare: one client holding the whole training set, one local SGD step.
    cfg = _fed_config(clients=1, rounds=1, local_steps=1, val_fraction=0.0, partition={"method": "iid"})
    fed = build_federation(cfg)
    client = LocalClient(cfg, fed.spec, fed.client_data)
    strategy = build_strategy(cfg.federated, client.layout)
    strategy.initialize(client.init, cfg.run.seed)
    # Execute: one federated round.
    ins = strategy.configure_round(1, [0])
    res, _ = client.fit(ins[0])
    strategy.aggregate(1, [res], [])
    # Reference: plain SGD on the same batch (the client's sampler seed for round 1).
    seed_everything(cfg.run.seed)
    model = build_model(cfg.model, fed.spec)
    batch = ShardSampler(
        fed.shards[0], cfg.train.batch_size, seed=client_seed(cfg.run.seed, 1, 0)
    ).next_batch()
    x, y = fed.train.get_batch(batch)
    CrossEntropy()(model(x), y).backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= cfg.optim.lr * p.grad
    expected = ParamLayout.of(model).flatten(model)
    # Assert: equal up to float32 rounding of (w + (w' − w)) — one ulp of weights ~0.3 is 3e-8.
    np.testing.assert_allclose(strategy.weights, expected, rtol=0, atol=1e-6)
    assert len(fed.shards[0]) == len(fed.train)


def _res(cid: int, n: int, update: np.ndarray, **metrics: object) -> FitRes:
    return FitRes(cid, 1, n, update.astype(np.float32), dict(metrics))


def test_fedavg_is_sample_weighted_and_accepts_a_presummed_result() -> None:
    cfg = _fed_config()
    layout = ParamLayout(("w",), ((3,),))
    s = FedAvg(cfg.federated, layout)
    s.initialize(np.zeros(3, np.float32), 0)
    u1, u2 = np.array([1.0, 0.0, 4.0]), np.array([5.0, 8.0, 0.0])
    s.aggregate(1, [_res(0, 1, u1), _res(1, 3, u2)], [])
    np.testing.assert_allclose(s.weights, (1 * u1 + 3 * u2) / 4, rtol=1e-6)
    # A secure-aggregation layer may hand over only the weighted mean with the total weight.
    t = FedAvg(cfg.federated, layout)
    t.initialize(np.zeros(3, np.float32), 0)
    t.aggregate(1, [_res(-1, 4, (1 * u1 + 3 * u2) / 4)], [])
    np.testing.assert_allclose(t.weights, s.weights, rtol=1e-6)
    assert s.aggregate(2, [], []) is None  # nothing returned: the model is kept


@pytest.mark.parametrize("name", ["fedavg", "fedprox", "fedadam", "fedyogi", "clustered", "personalized"])
def test_strategies_aggregate_uploads_read_as_views_of_the_message(name: str) -> None:
    # Prepare: three uploads through the wire; the server reads them as read-only views, no copy.
    cfg = _fed_config(strategy=name, mu=0.01, clusters=2, personal_layers=1)
    layout = ParamLayout(("w", "b"), ((3,), (2,)))
    rng = np.random.default_rng(0)
    size = build_strategy(cfg.federated, layout).update_size()
    blobs = [
        encode_res(_res(c, 5 + c, rng.standard_normal(size), model=c % 2, loss_after=1.0, local_accuracy=0.5))
        for c in range(3)
    ]
    views = [decode_res(b) for b in blobs]
    for res, blob in zip(views, blobs, strict=True):
        assert not res.update.flags.writeable and np.shares_memory(res.update, np.frombuffer(blob, np.uint8))
        assert check_update(res, size) is None
    copies = [FitRes(r.client_id, 1, r.num_samples, r.update.copy(), r.metrics) for r in views]
    # Execute: aggregate the views (writing into one would raise) and, as the reference, copies.
    got, want = build_strategy(cfg.federated, layout), build_strategy(cfg.federated, layout)
    for s, results in ((got, views), (want, copies)):
        s.initialize(np.zeros(layout.size, np.float32), 0)
        s.aggregate(1, results, [])
    # Assert: the same model, bit for bit.
    np.testing.assert_array_equal(got.weights, want.weights)


def test_proximal_term_is_the_gradient_of_mu_half_squared_distance() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    anchor = [p.detach().clone() + 0.1 * torch.randn_like(p) for p in model.parameters()]
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    mu = 0.3
    loss_fn = CrossEntropy()
    loss_fn(model(x), y).backward()
    ProximalTerm(mu, anchor).after_backward(SimpleNamespace(model=model))  # type: ignore[arg-type]
    with_plugin = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    prox = sum(((p - a) ** 2).sum() for p, a in zip(model.parameters(), anchor, strict=True))
    (loss_fn(model(x), y) + mu / 2 * prox).backward()
    for got, p in zip(with_plugin, model.parameters(), strict=True):
        torch.testing.assert_close(got, p.grad, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("cls", [FedAdam, FedYogi])
def test_server_optimizers_follow_their_update_rules(cls: type[FedAdam]) -> None:
    cfg = _fed_config(strategy=cls.name, server_lr=0.1, server_beta1=0.9, server_beta2=0.99, server_tau=1e-3)
    s = cls(cfg.federated, ParamLayout(("w",), ((2,),)))
    s.initialize(np.zeros(2, np.float32), 0)
    d1, d2 = np.array([1.0, -2.0]), np.array([0.5, 0.5])
    s.aggregate(1, [_res(0, 1, d1)], [])
    s.aggregate(2, [_res(0, 1, d2)], [])
    m1, v1 = 0.1 * d1, 0.01 * d1**2
    m2 = 0.9 * m1 + 0.1 * d2
    v2 = 0.99 * v1 + 0.01 * d2**2 if cls is FedAdam else v1 - 0.01 * d2**2 * np.sign(v1 - d2**2)
    w = 0.1 * m1 / (np.sqrt(v1) + 1e-3) + 0.1 * m2 / (np.sqrt(v2) + 1e-3)
    np.testing.assert_allclose(s.weights, w, rtol=1e-5)


def test_clustered_routes_updates_and_integrates_by_size_and_quality() -> None:
    cfg = _fed_config(strategy="clustered", clusters=2, cluster_init_noise=0.0)
    s = Clustered(cfg.federated, ParamLayout(("w",), ((2,),)))
    s.initialize(np.zeros(2, np.float32), 0)
    results = [
        _res(0, 10, np.array([1.0, 1.0]), model=0, loss_after=1.0),
        _res(1, 30, np.array([3.0, 3.0]), model=0, loss_after=1.0),
        _res(2, 20, np.array([-4.0, 0.0]), model=1, loss_after=3.0),
    ]
    s.aggregate(1, results, [])
    np.testing.assert_allclose(s.clusters[0], [2.5, 2.5])  # (10·1 + 30·3) / 40
    np.testing.assert_allclose(s.clusters[1], [-4.0, 0.0])
    a = np.array([40 * (1 / 2), 20 * (1 / 4)])  # nₖ · 1/(1+ℓₖ)
    a /= a.sum()
    np.testing.assert_allclose(s.weights, a[0] * s.clusters[0] + a[1] * s.clusters[1], rtol=1e-6)


def test_clustered_clients_pick_the_best_cluster_and_personalized_heads_stay_local() -> None:
    cfg = _fed_config(strategy="personalized", clients=2, local_steps=3, personal_layers=2)
    fed = build_federation(cfg)
    client = LocalClient(cfg, fed.spec, fed.client_data)
    s = build_strategy(cfg.federated, client.layout)
    assert isinstance(s, Personalized)
    s.initialize(client.init, 0)
    ins = s.configure_round(1, [0])[0]
    res, head = client.fit(ins)
    head_len = client.layout.head_size(2)
    assert res.update.shape == (client.layout.size - head_len,)  # only the body is uploaded
    assert head is not None and head.shape == (head_len,)
    assert not np.allclose(head, client.init[-head_len:])  # the head trained, and stays with the client
    # IFCA: of a good and a useless model, the client trains the one with the lower loss.
    cfg2 = _fed_config(strategy="clustered", clusters=2, clients=2, local_steps=2)
    fed2 = build_federation(cfg2)
    c2 = LocalClient(cfg2, fed2.spec, fed2.client_data)
    good = s.weights.copy()
    good[: len(res.update)] += res.update
    from vatra.federated import FitIns

    useless = np.zeros_like(good)
    trained, _ = c2.fit(
        FitIns(0, 1, [useless, np.concatenate([good[: len(res.update)], head])], {"local_steps": 1})
    )
    assert trained.metrics["model"] == 1


def test_random_selector_is_seeded_and_adaptive_prefers_fast_useful_clients() -> None:
    cfg = config_from_dict({"federated": {"clients": 100, "exploration": 0.2}}).federated
    r1, r2 = RandomSelector(cfg, 7), RandomSelector(cfg, 7)
    assert r1.select(3, range(100), 10) == r2.select(3, range(100), 10)
    assert r1.select(3, range(100), 10) != r1.select(4, range(100), 10)
    a = AdaptiveSelector(cfg, 0)
    # Every client has been tried: the first 50 are fast, the rest 10x slower; loss equal.
    a.observe(
        1,
        [_res(c, 10, np.zeros(1), loss_before=1.0, duration_s=1.0 if c < 50 else 10.0) for c in range(100)],
        [],
    )
    picks = [c for r in range(2, 12) for c in a.select(r, range(100), 10)]
    assert sum(c < 50 for c in picks) / len(picks) > 0.8
    # Unexplored clients get picked: a fresh selector picks ε·k of the never-tried ones.
    b = AdaptiveSelector(cfg, 0)
    b.observe(1, [_res(c, 10, np.zeros(1), loss_before=1.0, duration_s=1.0) for c in range(90)], [])
    assert any(c >= 90 for c in b.select(2, range(100), 10))


def test_wire_rejects_wrong_shape_dtype_nan_and_garbage() -> None:
    good = _res(0, 5, np.ones(4))
    assert check_update(decode_res(encode_res(good)), 4) is None
    assert "shape" in str(check_update(good, 5))
    bad_dtype = FitRes(0, 1, 5, np.ones(4, dtype=np.float64))
    assert "dtype" in str(check_update(decode_res(encode_res(bad_dtype)), 4))
    nan = _res(0, 5, np.array([1.0, np.nan, 0.0, np.inf]))
    assert "non-finite" in str(check_update(nan, 4))
    with pytest.raises(WireError):
        decode_res(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")


def test_partitions_unequal_sizes_and_feature_shift() -> None:
    cfg = small_config(federated={"clients": 6, "partition": {"method": "iid", "size_skew": 1.0}})
    shards = client_shards(1000, None, 6, cfg.federated.partition, seed=0)
    sizes = [len(s) for s in shards]
    assert sum(sizes) == 1000 and len(set(sizes)) > 1
    assert len(np.unique(np.concatenate(shards))) == 1000
    cfg = small_config(
        federated={
            "clients": 4,
            "partition": {"method": "dirichlet", "feature_shift": ["identity", "rot180"]},
        }
    )
    fed = build_federation(cfg)
    x0, x1 = fed.client_data(0).train.x, fed.client_data(1).train.x
    torch.testing.assert_close(x1.reshape(-1, 8, 8).flip(1).flip(2), x0.reshape(-1, 8, 8))
    assert fed.shifts == ["identity", "rot180", "identity", "rot180"]
    # each client holds out val_fraction of its own rows, disjoint from the rows it trains on
    for c in range(4):
        data = fed.client_data(c)
        assert not set(data.train_rows) & set(data.val_rows)
        assert sorted([*data.train_rows, *data.val_rows]) == fed.shards[c].tolist()
        assert data.num_val == round(0.2 * len(fed.shards[c]))
    with pytest.raises(ConfigError, match="feature_shift"):
        small_config(federated={"partition": {"feature_shift": ["spin"]}})
    with pytest.raises(ConfigError, match="mu"):
        build_strategy(
            small_config(federated={"strategy": "fedprox"}).federated, ParamLayout(("w",), ((1,),))
        )


@pytest.mark.parametrize("method", ["fp16", "bf16", "topk", "qsgd"])
def test_compressed_upload_round_trips_through_the_wire(method: str) -> None:
    from vatra.federated.compression import build_upload_hook

    cfg = small_config(federated={"compression": method}, comm={"ratio": 0.1, "min_numel": 16})
    layout = ParamLayout(("w", "b"), ((40, 8), (8,)))
    hook = build_upload_hook(cfg, layout)
    update = np.random.default_rng(0).standard_normal(layout.size).astype(np.float32)
    sent = hook.encode(_res(0, 5, update.copy()), None)  # type: ignore[arg-type]
    blob = encode_res(sent)
    got = hook.decode(decode_res(blob))
    assert check_update(got, layout.size) is None
    assert len(blob) < len(encode_res(_res(0, 5, update)))  # fewer bytes on the wire
    np.testing.assert_array_equal(got.update[-8:], update[-8:])  # the small bias travels raw
    if method == "fp16":
        np.testing.assert_allclose(got.update, update, rtol=1e-3)
    if method == "topk":  # exactly the 10% largest-magnitude weights survive
        w = update[:320]
        kept = np.flatnonzero(got.update[:320])
        assert set(kept) == set(np.argsort(-np.abs(w))[:32])
    sent.payload = {"0.0": np.zeros(3, np.float32)}  # a malformed payload is a wire error, not a crash
    with pytest.raises(WireError):
        hook.decode(sent)
