"""A task's main metric: the one figure a run leads with (the console, the report, a federated target).

The pick is by name, over the names a task's :class:`~vatra.losses.Metrics` report: accuracy
(classification, multilabel), NDCG@k (ranking), R² (regression), perplexity (lm), else the loss
(multitask, whose heads each have their own: ``{head}_{metric}``).
"""

from __future__ import annotations

from collections.abc import Iterable

MAIN_METRICS = ("accuracy", "ndcg@", "r2", "perplexity", "loss")  # name prefixes, in order of preference
LOWER_IS_BETTER = ("loss", "perplexity", "mae", "rmse")  # the rest (accuracy, F1, AUC, NDCG, R²) rise


def main_metric(names: Iterable[str]) -> str | None:
    """The first of ``names`` that starts with the most preferred prefix of :data:`MAIN_METRICS`."""
    names = list(names)
    for prefix in MAIN_METRICS:
        for name in names:
            if name.startswith(prefix):
                return name
    return None


def head_main_metrics(names: Iterable[str], heads: Iterable[str]) -> list[str]:
    """Each multitask head's main metric, ``{head}_{metric}``, among ``names`` (a head without any is
    left out)."""
    names = list(names)
    out = []
    for head in heads:
        own = main_metric(n.removeprefix(f"{head}_") for n in names if n.startswith(f"{head}_"))
        if own is not None:
            out.append(f"{head}_{own}")
    return out


def is_main_family(name: str) -> bool:
    """Whether ``name`` (or a head's ``{head}_{name}``) is a metric :func:`main_metric` could pick."""
    return name.startswith(MAIN_METRICS) or name.rsplit("_", 1)[-1].startswith(MAIN_METRICS)


def lower_is_better(name: str) -> bool:
    """Whether smaller values of ``name`` (or a head's ``{head}_{name}``) are better."""
    return name.rsplit("_", 1)[-1] in LOWER_IS_BETTER
