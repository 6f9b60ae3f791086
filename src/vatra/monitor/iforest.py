"""IsolationForest over the feature vector: scikit-learn fits, a vectorised numpy walk scores."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from sklearn.ensemble import IsolationForest

from vatra.config._monitor import MonitorConfig
from vatra.monitor._base import register
from vatra.monitor._learned import LearnedDetector

EULER_GAMMA = 0.5772156649015329


def average_path_length(n: np.ndarray) -> np.ndarray:
    """c(n): the mean depth of an unsuccessful search in a binary search tree of n points."""
    n = np.asarray(n, dtype=np.float64)
    out = np.zeros_like(n)
    out[n == 2] = 1.0
    big = n > 2
    out[big] = 2.0 * (np.log(n[big] - 1.0) + EULER_GAMMA) - 2.0 * (n[big] - 1.0) / n[big]
    return out


@dataclass
class PackedForest:
    """Every tree of a fitted forest in padded (trees, nodes) arrays.

    scikit-learn's ``score_samples`` costs several milliseconds per call (one Python call per
    tree); walking all trees at once in numpy costs tens of microseconds for a few rows, which is
    what scoring every step on rank 0 can afford.
    """

    left: np.ndarray  # (T, N) child index, -1 at leaves
    right: np.ndarray  # (T, N)
    feature: np.ndarray  # (T, N) feature index into the full vector
    threshold: np.ndarray  # (T, N)
    leaf_depth: np.ndarray  # (T, N) depth + c(samples at node): the path length if the walk ends here
    max_depth: int
    norm: float  # c(max_samples)

    @classmethod
    def from_sklearn(cls, forest: IsolationForest) -> PackedForest:
        trees = [e.tree_ for e in forest.estimators_]
        n_nodes = max(t.node_count for t in trees)
        shape = (len(trees), n_nodes)
        left, right = np.full(shape, -1, np.int64), np.full(shape, -1, np.int64)
        feature, thr = np.zeros(shape, np.int64), np.zeros(shape, np.float64)
        leaf_depth = np.zeros(shape, np.float64)
        max_depth = 0
        for i, (t, feats) in enumerate(zip(trees, forest.estimators_features_, strict=True)):
            k = t.node_count
            left[i, :k], right[i, :k] = t.children_left, t.children_right
            feature[i, :k] = np.asarray(feats)[np.maximum(t.feature, 0)]
            thr[i, :k] = t.threshold
            depth = np.zeros(k, np.int64)
            for node in range(k):  # parents precede children in sklearn's node order
                if t.children_left[node] >= 0:
                    depth[t.children_left[node]] = depth[node] + 1
                    depth[t.children_right[node]] = depth[node] + 1
            leaf_depth[i, :k] = depth + average_path_length(t.n_node_samples)
            max_depth = max(max_depth, int(depth.max()))
        norm = float(average_path_length(np.array([forest.max_samples_]))[0])
        return cls(left, right, feature, thr, leaf_depth, max_depth, norm)

    def score(self, x: np.ndarray) -> np.ndarray:
        """Anomaly score in (0, 1) of each row of ``x`` (n, F); equals ``-forest.score_samples(x)``."""
        x = np.asarray(x, np.float32).astype(np.float64)  # scikit-learn compares float32 inputs
        n_trees = self.left.shape[0]
        tree_idx = np.arange(n_trees)[:, None]  # (T, 1)
        node = np.zeros((n_trees, len(x)), np.int64)  # (T, n)
        rows = np.arange(len(x))[None, :]
        for _ in range(self.max_depth):
            go_left = x[rows, self.feature[tree_idx, node]] <= self.threshold[tree_idx, node]
            child = np.where(go_left, self.left[tree_idx, node], self.right[tree_idx, node])
            node = np.where(child >= 0, child, node)
        depth = self.leaf_depth[tree_idx, node].mean(axis=0)  # (n,)
        return np.power(2.0, -depth / self.norm)


@dataclass
class BoxedForest:
    """A packed forest and the box of its training rows, widened by ``box_margin`` × its width.

    An isolation tree sends every point beyond the training range to the same leaf as the most
    extreme training point, so on its own it scores a 1000× spike like an ordinary large value. A
    point outside the widened box would be cut off by the first split: it scores 1.0 (path length 0).
    """

    forest: PackedForest
    low: np.ndarray  # (F,)
    high: np.ndarray  # (F,)

    def score(self, x: np.ndarray) -> np.ndarray:
        outside = ((x < self.low) | (x > self.high)).any(axis=1)
        return np.where(outside, 1.0, self.forest.score(x))


@register("iforest")
class IsolationForestDetector(LearnedDetector):
    """scikit-learn's IsolationForest on the clean rows; score = 2^(−mean path length / c(ψ))."""

    n_estimators = 100
    box_margin = 2.0
    max_threshold = 0.95

    def __init__(self, cfg: MonitorConfig, n_features: int, seed: int = 0) -> None:
        super().__init__(cfg, n_features)
        self.seed = seed

    def _fit(self, x: np.ndarray) -> BoxedForest:
        forest = IsolationForest(
            n_estimators=self.n_estimators,
            max_samples=min(256, len(x)),
            random_state=self.seed + self.fits,
        ).fit(x)
        low, high = x.min(axis=0), x.max(axis=0)
        width = high - low
        return BoxedForest(
            PackedForest.from_sklearn(forest), low - self.box_margin * width, high + self.box_margin * width
        )

    def _fit_and_calibrate(self, x: np.ndarray) -> tuple[BoxedForest, float]:
        model, thr = super()._fit_and_calibrate(x)
        return model, min(thr, self.max_threshold)  # scores never exceed 1: keep the bar reachable

    def _score(self, model: BoxedForest, x: np.ndarray) -> np.ndarray:
        return model.score(x)
