"""Accuracy of server-side models on every client's own test distribution."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from vatra.federated.data import Federation
from vatra.federated.params import ParamLayout

EVAL_BATCH = 1024


@torch.no_grad()
def class_scores(
    model: nn.Module, layout: ParamLayout, vec: np.ndarray, x: torch.Tensor, y: torch.Tensor, classes: int
) -> tuple[np.ndarray, np.ndarray]:
    """Per-class accuracy and mean loss of weights ``vec`` on (x, y): two (classes,) arrays."""
    layout.load(model, vec)
    model.eval()
    logits = torch.cat([model(x[i : i + EVAL_BATCH]) for i in range(0, len(x), EVAL_BATCH)])  # (N, classes)
    losses = torch.nn.functional.cross_entropy(logits, y, reduction="none").double().numpy()
    correct = (logits.argmax(dim=1) == y).double().numpy()
    counts = np.maximum(np.bincount(y.numpy(), minlength=classes), 1)
    acc = np.bincount(y.numpy(), weights=correct, minlength=classes) / counts
    loss = np.bincount(y.numpy(), weights=losses, minlength=classes) / counts
    return acc, loss


class Evaluator:
    """Scores models the way each client would see them.

    Client ``c``'s test set is the held-out split under its own input transform, with classes
    weighted like its training shard, so a client that only holds 3s and 8s is scored on 3s and 8s.
    ``global_accuracy`` weights clients by their sample counts (the pooled distribution).
    """

    def __init__(self, fed: Federation, model: nn.Module) -> None:
        self.fed = fed
        self.model = model
        self.layout = ParamLayout.of(model)
        self.classes = fed.spec.num_classes

    def _per_shift(self, vec: np.ndarray, shifts: Sequence[str]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        out = {}
        for s in shifts:
            split = self.fed.val_for_shift(s)
            assert split.y is not None
            out[s] = class_scores(self.model, self.layout, vec, split.x, split.y, self.classes)
        return out

    def client_scores(self, models: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """(accuracy, loss), each (clients, models): every client scored with every model."""
        shifts = sorted(set(self.fed.shifts))
        acc = np.zeros((self.fed.num_clients, len(models)))
        loss = np.zeros_like(acc)
        for m, vec in enumerate(models):
            scores = self._per_shift(vec, shifts)
            for c, s in enumerate(self.fed.shifts):
                acc[c, m] = self.fed.label_hist[c] @ scores[s][0]
                loss[c, m] = self.fed.label_hist[c] @ scores[s][1]
        return acc, loss

    def own_model_scores(self, per_client: Sequence[np.ndarray]) -> np.ndarray:
        """Accuracy of client ``c`` with its own model ``per_client[c]``: (clients,)."""
        out = np.zeros(self.fed.num_clients)
        for c, vec in enumerate(per_client):
            s = self.fed.shifts[c]
            out[c] = self.fed.label_hist[c] @ self._per_shift(vec, [s])[s][0]
        return out

    def summarize(self, global_acc: np.ndarray, client_acc: np.ndarray) -> dict[str, Any]:
        """``global_acc``: each client's accuracy with the global model; ``client_acc``: with its own."""
        w = self.fed.sizes / self.fed.sizes.sum()
        return {
            "global_accuracy": float(w @ global_acc),
            "mean_client_accuracy": float(client_acc.mean()),
            "worst_client_accuracy": float(client_acc.min()),
        }
