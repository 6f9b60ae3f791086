"""Datasets, partitioners and the resumable shard sampler."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vatra.config import DataConfig
from vatra.data import PARTITIONERS, ShardSampler, build_dataset, partition
from vatra.errors import ConfigError
from vatra.registry import DATASETS

SMALL = {
    "digits": DataConfig(name="digits"),
    "synthetic": DataConfig(name="synthetic", samples=600, n_features=12, informative=6, classes=4),
    "text": DataConfig(name="text", max_chars=50_000, block_size=16, val_windows=20),
}


@pytest.fixture(scope="module")
def digit_labels() -> np.ndarray:
    train, _, _ = build_dataset(DataConfig(name="digits"), 0)
    labels = train.labels
    assert labels is not None
    return labels


# --- datasets -------------------------------------------------------------------------------


def test_registry_lists_every_dataset() -> None:
    assert {"digits", "synthetic", "text"} <= set(DATASETS.names())


@pytest.mark.parametrize("name", ["digits", "synthetic"])
def test_classification_shapes_and_split_sizes(name: str) -> None:
    cfg = SMALL[name]

    train, val, spec = build_dataset(cfg, 0)

    assert spec.kind == "classification"
    n_total = len(train) + len(val)
    assert len(val) == pytest.approx(cfg.val_fraction * n_total, abs=1)
    assert train.x.dtype == torch.float32 and train.x.shape[1:] == spec.input_shape
    assert train.y is not None and train.y.dtype == torch.int64
    assert set(np.unique(train.labels)) == set(range(spec.num_classes))
    x, y = train.get_batch(np.array([0, 3, 5]))
    assert x.shape == (3, *spec.input_shape) and y.shape == (3,)


def test_digits_are_scaled_images() -> None:
    train, _, spec = build_dataset(SMALL["digits"], 0)

    assert spec.input_shape == (64,) and spec.image_shape == (1, 8, 8) and spec.num_classes == 10
    assert float(train.x.min()) >= 0.0 and float(train.x.max()) <= 1.0


def test_synthetic_is_standardised_with_train_statistics() -> None:
    train, _, spec = build_dataset(SMALL["synthetic"], 0)

    assert spec.image_shape is None
    torch.testing.assert_close(train.x.mean(0), torch.zeros(12), atol=1e-4, rtol=0)
    torch.testing.assert_close(train.x.std(0, correction=0), torch.ones(12), atol=1e-3, rtol=0)


def test_text_windows_are_shifted_by_one() -> None:
    cfg = SMALL["text"]

    train, val, spec = build_dataset(cfg, 0)

    assert spec == type(spec)("lm", (16,), 256, None)
    assert train.labels is None and train.x.dtype == torch.int64
    assert train.x.numel() + val.x.numel() == cfg.max_chars
    assert train.x.numel() == int(0.9 * cfg.max_chars)  # first 90% train, rest val
    assert len(train) == train.x.numel() - cfg.block_size
    assert len(val) == cfg.val_windows
    inputs, targets = train.get_batch(torch.tensor([0, len(train) - 1]))
    assert inputs.shape == targets.shape == (2, 16)
    torch.testing.assert_close(inputs[:, 1:], targets[:, :-1])
    assert targets[1, -1] == train.x[-1]  # the last start reaches the end of the stream exactly


def test_text_validation_windows_cover_the_val_stream() -> None:
    _, val, _ = build_dataset(SMALL["text"], 0)

    assert val.starts is not None
    assert int(val.starts[0]) == 0 and int(val.starts[-1]) == val.x.numel() - 16 - 1
    assert bool((val.starts.diff() > 0).all())


@pytest.mark.parametrize("name", ["digits", "synthetic", "text"])
def test_datasets_are_deterministic(name: str) -> None:
    a_train, a_val, a_spec = build_dataset(SMALL[name], 3)
    b_train, b_val, b_spec = build_dataset(SMALL[name], 3)

    assert a_spec == b_spec
    for a, b in ((a_train, b_train), (a_val, b_val)):
        torch.testing.assert_close(a.x, b.x, rtol=0, atol=0)
        assert (a.y is None and b.y is None) or torch.equal(a.y, b.y)


def test_unknown_dataset_is_a_config_error() -> None:
    cfg = DataConfig.model_construct(name="imagenet")

    with pytest.raises(ConfigError, match="unknown dataset 'imagenet'; choose one of: delta, digits, images"):
        build_dataset(cfg, 0)


# --- partitioners ---------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", sorted(PARTITIONERS))
@pytest.mark.parametrize("num_shards", [1, 2, 3, 5, 8])
def test_every_index_lands_in_exactly_one_shard(
    strategy: str, num_shards: int, digit_labels: np.ndarray
) -> None:
    n = len(digit_labels)
    k = -(-10 // num_shards)  # label_skew must hold all 10 classes between the shards

    shards = partition(n, digit_labels, num_shards, strategy, seed=1, alpha=0.3, classes_per_shard=k)

    assert len(shards) == num_shards
    assert all(len(s) > 0 and s.dtype == np.int64 for s in shards)
    np.testing.assert_array_equal(np.sort(np.concatenate(shards)), np.arange(n))


@pytest.mark.parametrize("num_shards", [2, 3, 4, 5, 7])
def test_stratified_is_balanced_per_class_and_per_shard(num_shards: int, digit_labels: np.ndarray) -> None:
    n = len(digit_labels)

    shards = partition(n, digit_labels, num_shards, "stratified", seed=0)

    sizes = np.array([len(s) for s in shards])
    assert np.all(np.abs(sizes - n / num_shards) < 1)
    for c in range(10):
        n_c = int((digit_labels == c).sum())
        per_shard = np.array([(digit_labels[s] == c).sum() for s in shards])
        assert np.all(np.abs(per_shard - n_c / num_shards) < 1), (c, per_shard)


def _mean_tv_distance(shards: list[np.ndarray], labels: np.ndarray) -> float:
    """Mean total-variation distance between each shard's label histogram and the global one."""
    global_hist = np.bincount(labels, minlength=10) / len(labels)
    dists = [0.5 * np.abs(np.bincount(labels[s], minlength=10) / len(s) - global_hist).sum() for s in shards]
    return float(np.mean(dists))


def test_dirichlet_skew_grows_as_alpha_shrinks(digit_labels: np.ndarray) -> None:
    n = len(digit_labels)

    skew = {
        alpha: np.mean(
            [
                _mean_tv_distance(
                    partition(n, digit_labels, 4, "dirichlet", seed=s, alpha=alpha), digit_labels
                )
                for s in range(4)
            ]
        )
        for alpha in (0.1, 1.0, 100.0)
    }

    assert skew[0.1] > skew[1.0] > skew[100.0]
    assert skew[100.0] < 0.1  # near-IID


def test_dirichlet_never_leaves_a_shard_empty(digit_labels: np.ndarray) -> None:
    shards = partition(len(digit_labels), digit_labels, 50, "dirichlet", seed=0, alpha=0.01)

    assert min(len(s) for s in shards) >= 1


@pytest.mark.parametrize(("num_shards", "k"), [(5, 2), (4, 3), (10, 1), (3, 4)])
def test_label_skew_holds_at_most_k_classes_and_covers_all(
    num_shards: int, k: int, digit_labels: np.ndarray
) -> None:
    shards = partition(len(digit_labels), digit_labels, num_shards, "label_skew", seed=0, classes_per_shard=k)

    held = [set(np.unique(digit_labels[s])) for s in shards]
    assert all(len(h) <= k for h in held)
    assert set().union(*held) == set(range(10))


def test_label_skew_that_would_drop_classes_is_a_config_error(digit_labels: np.ndarray) -> None:
    with pytest.raises(ConfigError, match="classes_per_shard to at least 5"):
        partition(len(digit_labels), digit_labels, 2, "label_skew", seed=0, classes_per_shard=2)


def test_text_with_stratified_sharding_is_a_clear_config_error() -> None:
    train, _, _ = build_dataset(SMALL["text"], 0)

    with pytest.raises(ConfigError, match=r"'stratified' needs a labelled dataset.*use random or contiguous"):
        partition(len(train), train.labels, 2, "stratified", seed=0)


def test_partition_rejects_bad_arguments(digit_labels: np.ndarray) -> None:
    with pytest.raises(ConfigError, match="choose one of: contiguous, dirichlet"):
        partition(10, None, 2, "zigzag", seed=0)
    with pytest.raises(ConfigError, match="cannot split 3 samples into 4"):
        partition(3, None, 4, "random", seed=0)


def test_contiguous_keeps_dataset_order() -> None:
    shards = partition(10, None, 3, "contiguous", seed=0)

    assert [s.tolist() for s in shards] == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]


# --- sampler --------------------------------------------------------------------------------


def test_sampler_epoch_is_a_permutation_and_batches_cross_epochs() -> None:
    indices = np.arange(100, 137)  # 37 samples: batches of 8 straddle every epoch boundary
    sampler = ShardSampler(indices, 8, seed=5)

    stream = np.concatenate([sampler.next_batch() for _ in range(10)])  # 80 = 2 epochs + 6

    np.testing.assert_array_equal(np.sort(stream[:37]), indices)
    np.testing.assert_array_equal(np.sort(stream[37:74]), indices)
    assert not np.array_equal(stream[:37], stream[37:74])  # reshuffled each epoch
    expected_e1 = indices[np.random.default_rng([5, 1]).permutation(37)]
    np.testing.assert_array_equal(stream[37:74], expected_e1)
    assert (sampler.epoch, sampler.position) == (2, 6)


def test_sampler_restored_mid_epoch_continues_identically() -> None:
    indices = np.arange(0, 200, 5)  # 40 samples
    original = ShardSampler(indices, 7, seed=11)
    for _ in range(8):  # 56 samples in: epoch 1, position 16
        original.next_batch()

    restored = ShardSampler(indices, 7, seed=11)
    restored.load_state_dict(original.state_dict())

    assert original.state_dict() == {"epoch": 1, "position": 16, "seed": 11, "size": 40}
    remaining = restored.remaining_in_epoch()
    np.testing.assert_array_equal(remaining, original.remaining_in_epoch())
    assert len(remaining) == 24
    head = np.concatenate([restored.next_batch() for _ in range(4)])[:24]  # 28 drawn, 24 in epoch 1
    np.testing.assert_array_equal(head, remaining)
    for _ in range(4):
        original.next_batch()
    for _ in range(20):
        np.testing.assert_array_equal(restored.next_batch(), original.next_batch())


def test_sampler_without_shuffle_walks_in_order() -> None:
    sampler = ShardSampler(np.arange(5), 3, seed=0, shuffle=False)

    assert [sampler.next_batch().tolist() for _ in range(3)] == [[0, 1, 2], [3, 4, 0], [1, 2, 3]]


def test_sampler_rejects_state_from_another_shard_or_seed() -> None:
    state = ShardSampler(np.arange(10), 4, seed=0).state_dict()

    with pytest.raises(ValueError, match="shard of 10 samples but this shard has 9"):
        ShardSampler(np.arange(9), 4, seed=0).load_state_dict(state)
    with pytest.raises(ValueError, match="saved with seed 0 but this sampler uses 1"):
        ShardSampler(np.arange(10), 4, seed=1).load_state_dict(state)


def test_sampler_advance_moves_exactly_like_next_batch() -> None:
    a, b = ShardSampler(np.arange(10), 4, seed=1), ShardSampler(np.arange(10), 4, seed=1)
    for _ in range(7):  # crosses epoch boundaries mid-batch and exactly
        a.next_batch()
        b.advance()
        assert a.state_dict() == b.state_dict()
