# Tests for bench.partition on the real Fashion-MNIST labels: spec parsing, partitions, server holdout.
from __future__ import annotations

import numpy as np
import pytest

from bench.partition import PartitionSpec, parse_partition, partition_indices
from coordinator.rounds.holdout import server_holdout
from edge_agent.data.fashion_mnist import DEFAULT_DATA_DIR, read_idx


@pytest.fixture(scope="module")
def train_labels() -> np.ndarray:
    """The real Fashion-MNIST training labels (60000, 6000 per class)."""
    return read_idx(DEFAULT_DATA_DIR / "train-labels-idx1-ubyte.gz")


def assert_disjoint_cover(parts: list[np.ndarray], indices: np.ndarray) -> None:
    """Every index appears in exactly one part and nothing else appears."""
    joined = np.concatenate(parts)
    assert len(joined) == len(indices)
    assert np.array_equal(np.sort(joined), np.sort(indices))


def top2_share(labels: np.ndarray, part: np.ndarray) -> float:
    """Fraction of a device's samples that belong to its two most common classes."""
    counts = np.sort(np.bincount(labels[part], minlength=10))
    return float(counts[-2:].sum() / counts.sum())


def test_parse_partition_accepts_the_four_forms():
    assert parse_partition("type1") == PartitionSpec("type1")
    assert parse_partition("type2") == PartitionSpec("type2")
    assert parse_partition("iid") == PartitionSpec("iid")
    assert parse_partition("dirichlet:0.3") == PartitionSpec("dirichlet", 0.3)
    assert parse_partition("clusters:3") == PartitionSpec("clusters", clusters=3)


@pytest.mark.parametrize("spec", ["clusters:0", "clusters:-1", "clusters:1.5", "clusters:", "clusters:x"])
def test_parse_partition_bad_cluster_count(spec):
    with pytest.raises(ValueError, match="K must be an integer >= 1"):
        parse_partition(spec)


def test_clusters_give_each_device_group_its_own_fifth_of_the_classes(train_labels):
    indices = np.arange(0, len(train_labels), 7)
    parts = partition_indices(train_labels, "clusters:3", 6, np.random.default_rng(0), indices=indices)
    classes = [set(np.unique(train_labels[part]).tolist()) for part in parts]
    assert classes == [{0, 1}, {0, 1}, {2, 3}, {2, 3}, {4, 5}, {4, 5}]
    joined = np.concatenate(parts)
    assert len(np.unique(joined)) == len(joined)
    held = indices[np.isin(train_labels[indices], [0, 1, 2, 3, 4, 5])]
    assert np.array_equal(np.sort(joined), held)
    sizes = [len(part) for part in parts]
    assert max(sizes) - min(sizes) <= 0.05 * max(sizes)


def test_five_clusters_cover_every_class_and_more_wrap_around(train_labels):
    indices = np.arange(0, len(train_labels), 11)
    five = partition_indices(train_labels, "clusters:5", 5, np.random.default_rng(1), indices=indices)
    assert_disjoint_cover(five, indices)
    assert [sorted(np.unique(train_labels[part]).tolist()) for part in five] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
    six = partition_indices(train_labels, "clusters:6", 6, np.random.default_rng(1), indices=indices)
    assert_disjoint_cover(six, indices)
    assert sorted(np.unique(train_labels[six[5]]).tolist()) == [0, 1]
    shared = np.isin(train_labels[indices], [0, 1]).sum()
    assert abs(len(six[0]) - len(six[5])) <= 2 and len(six[0]) + len(six[5]) == shared


def test_clusters_need_a_device_per_cluster(train_labels):
    with pytest.raises(ValueError, match="clusters:4 needs at least 4 devices, got 3"):
        partition_indices(train_labels, "clusters:4", 3, np.random.default_rng(0))


@pytest.mark.parametrize("spec", ["type3", "", "Type1", "dirichlet", "dirichlet0.5", "clusters", "cluster:2"])
def test_parse_partition_unknown(spec):
    expected = f"unknown partition '{spec}'; expected type1, type2, iid, dirichlet:ALPHA or clusters:K"
    with pytest.raises(ValueError) as caught:
        parse_partition(spec)
    assert str(caught.value) == expected


@pytest.mark.parametrize("spec", ["dirichlet:0", "dirichlet:-1", "dirichlet:abc", "dirichlet:nan", "dirichlet:inf"])
def test_parse_partition_bad_alpha(spec):
    with pytest.raises(ValueError, match="ALPHA must be"):
        parse_partition(spec)


def test_type1_four_devices_is_the_papers_split(train_labels):
    parts = partition_indices(train_labels, "type1", 4, np.random.default_rng(0))
    classes = [sorted(np.unique(train_labels[part]).tolist()) for part in parts]
    assert classes == [[0, 1], [2, 3], [4, 5, 6], [7, 8, 9]]
    assert [len(part) for part in parts] == [12000, 12000, 18000, 18000]
    assert_disjoint_cover(parts, np.arange(len(train_labels)))


def test_type1_other_device_counts(train_labels):
    rng = np.random.default_rng(0)
    three = partition_indices(train_labels, "type1", 3, rng)
    assert [sorted(np.unique(train_labels[p]).tolist()) for p in three] == [[0, 1, 2], [3, 4, 5], [6, 7, 8, 9]]
    ten = partition_indices(train_labels, "type1", 10, rng)
    assert [np.unique(train_labels[p]).tolist() for p in ten] == [[c] for c in range(10)]
    with pytest.raises(ValueError, match="1..10 devices"):
        partition_indices(train_labels, "type1", 11, rng)


@pytest.mark.parametrize("spec", ["iid", "type2"])
def test_iid_split_is_near_equal_and_balanced(train_labels, spec):
    subset = np.random.default_rng(1).choice(len(train_labels), size=10003, replace=False)
    parts = partition_indices(train_labels, spec, 4, np.random.default_rng(2), indices=subset)
    assert_disjoint_cover(parts, subset)
    assert sorted(len(p) for p in parts) == [2500, 2501, 2501, 2501]
    for part in parts:
        assert top2_share(train_labels, part) < 0.25  # IID: every class about 10%


def test_dirichlet_small_alpha_is_skewed_and_covering(train_labels):
    subset = np.arange(0, len(train_labels), 3)
    parts = partition_indices(train_labels, "dirichlet:0.1", 10, np.random.default_rng(7), indices=subset)
    assert_disjoint_cover(parts, subset)
    assert min(len(p) for p in parts) >= 10
    skewed = [top2_share(train_labels, p) for p in parts]
    iid = partition_indices(train_labels, "iid", 10, np.random.default_rng(7), indices=subset)
    assert np.median(skewed) > 0.7
    assert max(top2_share(train_labels, p) for p in iid) < 0.25


def test_dirichlet_large_alpha_is_near_uniform(train_labels):
    parts = partition_indices(train_labels, "dirichlet:1000", 5, np.random.default_rng(0))
    assert all(top2_share(train_labels, p) < 0.25 for p in parts)


def test_dirichlet_reproducible_with_seed(train_labels):
    first = partition_indices(train_labels, "dirichlet:0.5", 6, np.random.default_rng(42))
    second = partition_indices(train_labels, "dirichlet:0.5", 6, np.random.default_rng(42))
    other = partition_indices(train_labels, "dirichlet:0.5", 6, np.random.default_rng(43))
    assert all(np.array_equal(a, b) for a, b in zip(first, second))
    assert not all(np.array_equal(a, b) for a, b in zip(first, other))


def test_dirichlet_impossible_minimum_is_an_error(train_labels):
    with pytest.raises(ValueError, match="at least 10 samples per device"):
        partition_indices(train_labels, "dirichlet:1", 10, np.random.default_rng(0), indices=np.arange(99))
    with pytest.raises(ValueError, match="fewer than 10 samples in 100 draws"):
        partition_indices(train_labels, "dirichlet:0.001", 10, np.random.default_rng(0), indices=np.arange(100))


def test_partition_rejects_bad_indices(train_labels):
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="repeat"):
        partition_indices(train_labels, "iid", 2, rng, indices=np.array([1, 1, 2]))
    with pytest.raises(ValueError, match=r"\[0, 60000\)"):
        partition_indices(train_labels, "iid", 2, rng, indices=np.array([1, 60000]))
    with pytest.raises(ValueError, match="unknown partition"):
        partition_indices(train_labels, "bogus", 2, rng)


def test_server_holdout_balanced_and_disjoint(train_labels):
    init_idx, val_idx, rest_idx = server_holdout(train_labels, 103, 500, np.random.default_rng(5))
    counts = np.bincount(train_labels[init_idx], minlength=10)
    assert counts.tolist() == [11, 11, 11, 10, 10, 10, 10, 10, 10, 10]
    assert len(val_idx) == 500 and len(rest_idx) == 60000 - 603
    assert_disjoint_cover([init_idx, val_idx, rest_idx], np.arange(60000))
    again = server_holdout(train_labels, 103, 500, np.random.default_rng(5))
    assert all(np.array_equal(a, b) for a, b in zip((init_idx, val_idx, rest_idx), again))


def test_server_holdout_too_many_requested(train_labels):
    with pytest.raises(ValueError, match="--init-samples 60010: class 0 has 6000 labelled images"):
        server_holdout(train_labels, 60010, 0, np.random.default_rng(0))
    with pytest.raises(ValueError, match="--validation-samples 60000: only 59900 labelled images remain"):
        server_holdout(train_labels, 100, 60000, np.random.default_rng(0))
