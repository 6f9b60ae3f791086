"""Per-FedAvg: each client's local step is a first-order MAML step, checked against its formula on
a 2-parameter model; a simulated federation trains with it and scores clients personalised."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tests.conftest import small_config
from torch import nn

from vatra.errors import ConfigError
from vatra.federated.perfedavg import meta_gradient
from vatra.federated.simulation import simulate
from vatra.rundir import RunDir, read_jsonl


def _mse_grad(w: float, b: float, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    r = w * x + b - y
    return torch.stack([2 * (r * x).mean(), 2 * r.mean()])


def test_the_local_step_is_the_next_batch_gradient_at_the_personalised_weights() -> None:
    # Prepare: y = w·x + b, mean squared error, two batches D and D'
    model = nn.Linear(1, 1).double()
    with torch.no_grad():
        model.weight.fill_(0.7)
        model.bias.fill_(-0.2)
    xd, yd = (
        torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64),
        torch.tensor([1.0, -0.5, 3.0], dtype=torch.float64),
    )
    xe, ye = torch.tensor([1.5, -0.3], dtype=torch.float64), torch.tensor([2.0, 0.1], dtype=torch.float64)

    def loss(x: torch.Tensor, y: torch.Tensor):
        return lambda: ((model(x.unsqueeze(1)).squeeze(1) - y) ** 2).mean()

    # Execute
    meta_gradient(model, loss(xd, yd), loss(xe, ye), alpha=0.1)
    # Assert: ∇L_D'(w − α ∇L_D(w)) in .grad, and the weights are w again
    w_tilde = torch.tensor([0.7, -0.2], dtype=torch.float64) - 0.1 * _mse_grad(0.7, -0.2, xd, yd)
    want = _mse_grad(float(w_tilde[0]), float(w_tilde[1]), xe, ye)
    got = torch.stack([model.weight.grad.reshape(()), model.bias.grad.reshape(())])  # type: ignore[union-attr]
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert float(model.weight.detach()) == 0.7 and float(model.bias.detach()) == -0.2


def _fed(strategy: str, **extra: object):
    return small_config(
        federated={
            "strategy": strategy,
            "clients": 4,
            "rounds": 2,
            "local_steps": 3,
            "partition": {"method": "dirichlet", "alpha": 0.5},
            **extra,
        },
        monitor={"report": False},
    )


def test_a_perfedavg_federation_scores_its_clients_personalised(tmp_path: Path) -> None:
    # Execute: the same federation with perfedavg and with fedavg
    simulate(_fed("perfedavg", inner_lr=0.05), RunDir(tmp_path / "per"), progress=False)
    simulate(_fed("fedavg"), RunDir(tmp_path / "avg"), progress=False)
    per, avg = read_jsonl(tmp_path / "per" / "metrics.jsonl"), read_jsonl(tmp_path / "avg" / "metrics.jsonl")
    # Assert: both ran every round; the clients' own scores differ (other local steps, and a
    # personalisation step before scoring)
    assert [r["round"] for r in per] == [1, 2] == [r["round"] for r in avg]
    assert 0.0 <= per[-1]["mean_client_accuracy"] <= 1.0
    assert per[-1]["mean_client_accuracy"] != avg[-1]["mean_client_accuracy"]


def test_perfedavg_without_an_inner_lr_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"federated.inner_lr: perfedavg needs"):
        simulate(_fed("perfedavg"), RunDir(tmp_path), progress=False)
    with pytest.raises(ConfigError, match=r"federated.local_epochs: a perfedavg step reads two batches"):
        simulate(_fed("perfedavg", inner_lr=0.05, local_epochs=1), RunDir(tmp_path / "e"), progress=False)
