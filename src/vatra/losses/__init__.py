"""Task kinds and their losses (cross-entropy to ListNet and multi-task) and evaluation metrics."""

from __future__ import annotations

from vatra.losses._base import (
    TASKS,
    FunctionLoss,
    Loss,
    Metrics,
    build_loss,
    default_loss,
    load_loss,
    resolve_task,
)
from vatra.losses.classification import BCE, CrossEntropy
from vatra.losses.headline import (
    MAIN_METRICS,
    head_main_metrics,
    is_main_family,
    lower_is_better,
    main_metric,
)
from vatra.losses.metrics import (
    AUC_BINS,
    ClassificationMetrics,
    LanguageModelMetrics,
    MultilabelMetrics,
    MultitaskMetrics,
    RankingMetrics,
    RegressionMetrics,
    build_metrics,
)
from vatra.losses.multitask import Head, MultiTask
from vatra.losses.ranking import ListNet, listnet, ndcg_at_k
from vatra.losses.regression import MSE, Huber

__all__ = [
    "AUC_BINS",
    "BCE",
    "MAIN_METRICS",
    "MSE",
    "TASKS",
    "ClassificationMetrics",
    "CrossEntropy",
    "FunctionLoss",
    "Head",
    "Huber",
    "LanguageModelMetrics",
    "ListNet",
    "Loss",
    "Metrics",
    "MultiTask",
    "MultilabelMetrics",
    "MultitaskMetrics",
    "RankingMetrics",
    "RegressionMetrics",
    "build_loss",
    "build_metrics",
    "default_loss",
    "head_main_metrics",
    "is_main_family",
    "listnet",
    "load_loss",
    "lower_is_better",
    "main_metric",
    "ndcg_at_k",
    "resolve_task",
]
