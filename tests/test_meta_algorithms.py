"""The meta-gradients of MAML, first-order MAML, ANIL and Reptile against their formulas, worked by
hand on a 2-parameter model (y = w·x + b, mean squared error), in float64."""

from __future__ import annotations

import torch
from torch import nn

from vatra.meta.algorithms import InnerLoop, TaskLoss, evaluate_tasks, task_batch, task_meta_grad

# float64 throughout: the hand formulas and torch.func then agree to rounding (1e-12)
TOL = {"rtol": 1e-10, "atol": 1e-12}


def _line(w: float, b: float) -> nn.Linear:
    model = nn.Linear(1, 1).double()
    with torch.no_grad():
        model.weight.fill_(w)
        model.bias.fill_(b)
    return model


def _mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out.squeeze(-1) - y) ** 2).mean()


def _task() -> tuple[torch.Tensor, ...]:
    sx = torch.tensor([[0.5], [-1.0], [2.0]], dtype=torch.float64)
    sy = torch.tensor([1.0, -0.5, 3.0], dtype=torch.float64)
    qx = torch.tensor([[1.5], [-0.3]], dtype=torch.float64)
    qy = torch.tensor([2.0, 0.1], dtype=torch.float64)
    return sx, sy, qx, qy


def _grad_and_hessian(
    w: float, b: float, x: torch.Tensor, y: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """∇L and ∇²L of L(w, b) = mean((w x + b − y)²) over (w, b), from the closed forms."""
    x = x.squeeze(-1)
    r = w * x + b - y
    n = len(x)
    g = torch.stack([2 / n * (r * x).sum(), 2 / n * r.sum()])
    h = torch.tensor([[2 / n * (x * x).sum(), 2 / n * x.sum()], [2 / n * x.sum(), 2.0]], dtype=torch.float64)
    return g, h


def _flat(g: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.stack([g["weight"].reshape(()), g["bias"].reshape(())])


def _setup(w: float, b: float, alpha: float, algorithm: str, adapted: tuple[str, ...] = ("weight", "bias")):
    model = _line(w, b)
    params = dict(model.named_parameters())
    lrs = {n: torch.tensor(alpha, dtype=torch.float64) for n in adapted}
    loop = InnerLoop(algorithm, steps=1, adapted=adapted)  # type: ignore[arg-type]
    return TaskLoss(model, _mse, ways=0), loop, params, lrs


def test_maml_meta_gradient_is_the_hand_computed_second_order_gradient() -> None:
    # Prepare
    w, b, alpha = 0.7, -0.2, 0.1
    task_loss, loop, params, lrs = _setup(w, b, alpha, "maml")
    sx, sy, qx, qy = _task()
    # Execute
    g, g_lr, _, _ = task_meta_grad(task_loss, loop, params, lrs, sx, sy, qx, qy)
    # Assert: ∇θ Lq(θ − α∇Ls(θ)) = (I − α Hs) ∇Lq(φ), and ∂/∂α = −∇Ls(θ)·∇Lq(φ)
    gs, hs = _grad_and_hessian(w, b, sx, sy)
    phi = torch.tensor([w, b], dtype=torch.float64) - alpha * gs
    gq, _ = _grad_and_hessian(float(phi[0]), float(phi[1]), qx, qy)
    expected = (torch.eye(2, dtype=torch.float64) - alpha * hs) @ gq
    torch.testing.assert_close(_flat(g), expected, **TOL)
    torch.testing.assert_close(g_lr["weight"] + 0, -gs[0] * gq[0], **TOL)  # Meta-SGD's per-tensor LR
    torch.testing.assert_close(g_lr["bias"] + 0, -gs[1] * gq[1], **TOL)
    # the second-order term matters here: first order alone would be off
    assert not torch.allclose(_flat(g), gq)


def test_first_order_maml_is_the_query_gradient_at_the_adapted_parameters() -> None:
    w, b, alpha = 0.7, -0.2, 0.1
    task_loss, loop, params, lrs = _setup(w, b, alpha, "fomaml")
    sx, sy, qx, qy = _task()
    g, _, _, _ = task_meta_grad(task_loss, loop, params, lrs, sx, sy, qx, qy)
    gs, _ = _grad_and_hessian(w, b, sx, sy)
    phi = torch.tensor([w, b], dtype=torch.float64) - alpha * gs
    gq, _ = _grad_and_hessian(float(phi[0]), float(phi[1]), qx, qy)
    torch.testing.assert_close(_flat(g), gq, **TOL)


def test_anil_adapts_only_the_head_and_differentiates_through_it() -> None:
    # the bias plays the head: adapted with φ_b = b − α ∂Ls/∂b; w stays θ_w in the inner loop
    w, b, alpha = 0.7, -0.2, 0.1
    task_loss, loop, params, lrs = _setup(w, b, alpha, "anil", adapted=("bias",))
    sx, sy, qx, qy = _task()
    g, _, _, _ = task_meta_grad(task_loss, loop, params, lrs, sx, sy, qx, qy)
    gs, hs = _grad_and_hessian(w, b, sx, sy)
    phi_b = b - alpha * float(gs[1])
    gq, _ = _grad_and_hessian(w, phi_b, qx, qy)
    # d φ_b / d w = −α ∂²Ls/∂b∂w, d φ_b / d b = 1 − α ∂²Ls/∂b²
    expected = torch.stack([gq[0] + gq[1] * (-alpha * hs[1, 0]), gq[1] * (1 - alpha * hs[1, 1])])
    torch.testing.assert_close(_flat(g), expected, **TOL)


def test_reptile_direction_is_theta_minus_the_adapted_parameters() -> None:
    w, b, alpha = 0.7, -0.2, 0.1
    task_loss, _, params, lrs = _setup(w, b, alpha, "reptile")
    loop = InnerLoop("reptile", steps=2, adapted=("weight", "bias"))
    sx, sy, qx, qy = _task()
    g, _, _, _ = task_meta_grad(task_loss, loop, params, lrs, sx, sy, qx, qy)
    x, y = torch.cat([sx, qx]), torch.cat([sy, qy])
    theta = torch.tensor([w, b], dtype=torch.float64)
    phi = theta.clone()
    for _ in range(2):  # two plain SGD steps on every example of the task
        gx, _ = _grad_and_hessian(float(phi[0]), float(phi[1]), x, y)
        phi = phi - alpha * gx
    torch.testing.assert_close(_flat(g), theta - phi, **TOL)


def test_vmap_over_tasks_equals_the_loop_and_evaluation_adapts() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    params = dict(model.named_parameters())
    lrs = {n: torch.tensor(0.3, dtype=torch.float64) for n in params}
    loop = InnerLoop("maml", steps=2, adapted=tuple(params), ways=3)
    task_loss = TaskLoss(model, nn.functional.cross_entropy, ways=3)
    episodes = [
        (
            torch.randn(6, 4, dtype=torch.float64),
            torch.arange(6) % 3,
            torch.randn(9, 4, dtype=torch.float64),
            torch.arange(9) % 3,
        )
        for _ in range(3)
    ]
    batched, vectorised = task_batch(task_loss, loop, params, lrs, episodes)
    looped, _ = task_batch(task_loss, loop, params, lrs, episodes, vectorise=False)
    assert vectorised
    for n in params:
        torch.testing.assert_close(batched.grads[n], looped.grads[n], rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(batched.loss, looped.loss)
    loss, acc = evaluate_tasks(task_loss, loop, params, lrs, episodes)
    torch.testing.assert_close(loss, looped.loss)
    assert acc.shape == (3,) and bool(((acc >= 0) & (acc <= 1)).all())


def test_a_model_vmap_cannot_trace_falls_back_to_the_loop() -> None:
    # batch norm updates its running statistics in place, which vmap refuses: the tasks then loop
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
    params = {n: p.detach() for n, p in model.named_parameters()}
    lrs = {n: torch.tensor(0.1) for n in params}
    loop = InnerLoop("fomaml", steps=1, adapted=tuple(params), ways=3)
    episodes = [
        (torch.randn(6, 4), torch.arange(6) % 3, torch.randn(9, 4), torch.arange(9) % 3) for _ in range(2)
    ]
    batch, vectorised = task_batch(
        TaskLoss(model, nn.functional.cross_entropy, 3), loop, params, lrs, episodes
    )
    assert not vectorised
    assert all(bool(torch.isfinite(g).all()) and g.shape[0] == 2 for g in batch.grads.values())


def test_anil_head_is_the_last_module_with_parameters() -> None:
    from vatra.meta.plugin import head_names

    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3), nn.Identity())
    assert head_names(model, "auto") == ("2.weight", "2.bias")
    assert head_names(model, "0") == ("0.weight", "0.bias")
