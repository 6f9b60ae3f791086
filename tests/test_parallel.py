"""vatra.parallel on gloo (CPU): every layout trains as the unsplit model does in one process.

Two launches (4 ranks, then 2) each run several layouts one after the other on the same process
group; the parent trains the reference once (one process, the whole global batch) and compares
each layout's per-step loss, global gradient norm and parameters after the steps.

Tolerances (fp32): losses and norms rtol 1e-5 / atol 1e-6 — the splits change only the order of
fp32 sums (FSDP's reduce-scatter, TP's all-reduce of partial products, micro-batch means);
parameters after 3 SGD-momentum steps rtol 1e-4 / atol 1e-5, as those differences compound.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from tests._dist import spawn
from tests._parallel import (
    CLIP,
    LOSS_TOL,
    PARAM_TOL,
    SPEC,
    STEPS,
    USER_PLAN,
    Launched,
    _config,
    _data,
    _gpt,
    _indices,
    _trainer,
)
from tests.conftest import small_config
from torch.distributed.tensor import DTensor

import vatra
import vatra.assembly
from vatra.config import load_config
from vatra.engine import DistContext, Plugin, Trainer
from vatra.engine.optim import build_optimizer
from vatra.losses import build_loss
from vatra.parallel import (
    Mesh,
    build_pipeline,
    clip_,
    total_norm,
)
from vatra.resilience import CheckpointPlugin
from vatra.rundir import RunDir, read_jsonl

# One xdist worker for the module: its fixture's two launches run once, not once per worker.
pytestmark = pytest.mark.xdist_group("parallel")


def _full(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Collective for sharded modules: every parameter whole, by name."""
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in module.state_dict().items()
    }


def _gather(obj: Any) -> list[Any]:
    box: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(box, obj)
    return box


# ------------------------------------------------------------------ worker cases
def _train_case(ctx: DistContext, parallel: dict[str, Any]) -> dict[str, Any]:
    """The Trainer under a layout: its metrics and whole parameters after STEPS steps (pp: each
    rank's stage, merged)."""
    trainer = _trainer(_config(parallel), ctx, user="tp_plan" in parallel)
    steps = [trainer.train_step() for _ in range(STEPS)]
    state: dict[str, torch.Tensor] = {}
    for part in _gather(_full(trainer.model)):
        state.update(part)
    losses = _gather([m["loss"] for m in steps])  # each rank's own mean loss
    return {
        "losses": np.mean(losses, axis=0).tolist(),
        "norms": [m["grad_norm"] for m in steps],
        "state": state,
        "eval": trainer.evaluate(),
        "pp": _gather(
            [(m["pp_busy_s"], m["pp_bubble"], m["fwd_bwd_time_s"]) for m in steps if "pp_bubble" in m]
        ),
    }


def _pipeline_case(ctx: DistContext, parallel: dict[str, Any]) -> dict[str, Any]:
    """A pipelined gpt through vatra.parallel's API, the loop a user writes."""
    cfg = _config(parallel)
    par = cfg.parallel
    mesh = Mesh.build(par, ctx.device)
    x, y = _data()[_indices(mesh.data_rank, mesh.data_world)]
    loss_fn = build_loss(cfg.train, SPEC)
    example = x[: cfg.train.batch_size // par.n_microbatches]
    pipe = build_pipeline(_gpt(cfg), mesh, par, loss_fn, example)
    params = list(pipe.parameters())
    optimizer = build_optimizer(params, cfg.optim)
    losses, norms = [], []
    for step in range(STEPS):
        rows = slice(step * cfg.train.batch_size, (step + 1) * cfg.train.batch_size)
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(pipe.step(x[rows], y[rows])))
        counted = [p.grad for p in pipe.norm_parameters() if p.grad is not None]
        norm = float(total_norm(counted, mesh["pp"].get_group()))
        clip_([p.grad for p in params if p.grad is not None], CLIP, norm)
        optimizer.step()
        norms.append(norm)
    state: dict[str, torch.Tensor] = {}
    for stage in pipe.stages:
        state.update(_full(stage))
    merged: dict[str, torch.Tensor] = {}
    for part in _gather(state):
        merged.update(part)
    return {"losses": np.mean(_gather(losses), axis=0).tolist(), "norms": norms, "state": merged}


class _Loaded(Plugin):
    """Records the whole parameters right after the checkpoint plugin resumed (it runs first)."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_fit_start(self, trainer: Trainer) -> None:
        self._save(trainer, self.out)

    def on_fit_end(self, trainer: Trainer, summary: dict[str, Any]) -> None:
        self._save(trainer, self.out.with_suffix(".end.pt"))

    @staticmethod
    def _save(trainer: Trainer, path: Path) -> None:
        state: dict[str, torch.Tensor] = {}
        for part in _gather(_full(trainer.model)):  # pp: every stage's parameters
            state.update(part)
        if trainer.dist.is_main:
            torch.save({"step": trainer.state.step, "state": state}, path)


def _checkpoint_case(
    ctx: DistContext,
    parallel: dict[str, Any],
    run: Path,
    steps: int,
    out: Path,
    store: dict[str, Any] | None = None,
) -> None:
    """Train to ``steps`` under the layout with checkpoints in ``run`` or ``store`` (a saved run resumes)."""
    cfg = _config(parallel, train={"steps": steps}, checkpoint={"every_steps": 0}, store=store or {})
    rd = RunDir(run)
    if ctx.is_main:
        rd.create()
    ctx.barrier()
    _trainer(cfg, ctx, [CheckpointPlugin(cfg, rd), _Loaded(out)], run_dir=rd).fit()


CASES_4 = {
    "fsdp4": {"fsdp": 4},
    "fsdp2_tp2": {"fsdp": 2, "tp": 2},
    "dp2_tp2": {"dp": 2, "tp": 2},
    "pp4_gpipe": {"pp": 4, "schedule": "gpipe"},
    "pp4_1f1b": {"pp": 4, "schedule": "1f1b"},
    "dp2_pp2_1f1b": {"dp": 2, "pp": 2, "schedule": "1f1b"},
    "fsdp2_pp2_gpipe": {"fsdp": 2, "pp": 2, "schedule": "gpipe"},
    "tp2_pp2_1f1b": {"tp": 2, "pp": 2, "schedule": "1f1b"},
    "trainer_fsdp2_pp2_1f1b": {"fsdp": 2, "pp": 2, "schedule": "1f1b"},
    "fsdp2_tp2_sequence": {"fsdp": 2, "tp": 2, "sequence_parallel": True},
}
CASES_2 = {
    "tp2": {"tp": 2},
    "tp2_user_plan": {"tp": 2, "tp_plan": USER_PLAN},
    "tp2_sequence": {"tp": 2, "sequence_parallel": True},
    "fsdp2_bf16_offload": {"fsdp": 2, "fsdp_mixed_precision": "bf16", "fsdp_cpu_offload": True},
    "pp2_gpipe": {"pp": 2, "schedule": "gpipe"},
    "pp2_1f1b": {"pp": 2, "schedule": "1f1b"},
    "pp2_interleaved": {"pp": 2, "schedule": "interleaved_1f1b"},
    "pp2_zero_bubble": {"pp": 2, "schedule": "zero_bubble"},
    "trainer_pp2_gpipe": {"pp": 2, "schedule": "gpipe"},
    "trainer_pp2_interleaved": {"pp": 2, "schedule": "interleaved_1f1b"},
    "trainer_pp2_zero_bubble": {"pp": 2, "schedule": "zero_bubble"},
}


HEAL_STEPS, NAN_AT = 30, 20


def _heal_case(ctx: DistContext, parallel: dict[str, Any], run: Path) -> None:
    """The plugins ``vatra train`` runs (monitor, healing, checkpoints every 4 steps, writers) under a
    layout, with the model's output NaN at step 20: the healer must roll back and training go on."""
    sections: dict[str, dict[str, Any]] = {
        "train": {"steps": HEAL_STEPS},
        "monitor": {"warmup_steps": 10, "report": False},
        "chaos": {"inject_nan_at": [NAN_AT]},
        "checkpoint": {"every_steps": 4},
    }
    cfg = _config(parallel, **sections)
    rd = RunDir(run)
    if ctx.is_main:
        rd.create()
    ctx.barrier()
    trainer = _trainer(cfg, ctx, vatra.assembly.build_plugins(cfg, rd), run_dir=rd)
    summary = trainer.fit()
    state = _full(trainer.model)
    finite = all(_gather(all(bool(torch.isfinite(t).all()) for t in state.values())))
    if ctx.is_main:
        (run / "case.json").write_text(json.dumps({"finite": finite, "steps": summary["steps"]}))


def _auto_case(ctx: DistContext, run: Path) -> None:
    """``vatra.fit`` with ``parallel.auto`` on this job's process group (RANK and WORLD_SIZE say so)."""
    os.environ.update(RANK=str(ctx.rank), WORLD_SIZE=str(ctx.world_size))
    sections: dict[str, dict[str, Any]] = {
        "train": {"task": "lm", "steps": 2},
        "checkpoint": {"enabled": False},
        "monitor": {"enabled": False},
    }
    cfg = _config({"auto": True}, **sections)
    vatra.fit(cfg, model=_gpt(cfg), train=_data(), val=None, run_dir=run)


def _worker(rank: int, world: int, rdzv: str, out: str) -> None:
    torch.set_num_threads(1)
    ctx = DistContext.init(small_config().dist, rank=rank, world_size=world, init_method=f"file://{rdzv}")
    folder, run = Path(out), Path(out) / "run"
    try:
        cases = CASES_4 if world == 4 else CASES_2
        for name, parallel in cases.items():
            case = _pipeline_case if "pp" in parallel and not name.startswith("trainer") else _train_case
            result = case(ctx, parallel)
            if rank == 0:
                torch.save(result, folder / f"{name}.pt")
        # a checkpoint of fsdp = 4 after 2 steps, resumed on fsdp = 2 (DCP reshards on load)
        steps = 2 if world == 4 else STEPS
        _checkpoint_case(ctx, {"fsdp": world}, run, steps, folder / f"loaded{world}.pt")
        if world == 4:  # fsdp × tp: saved after 2 steps, resumed on the same layout, one more step,
            # through the erasure-coded store (k 2 of m 3 nodes), one node lost before the resume
            nodes = [folder / f"node{i}" for i in range(3)]
            store = {"erasure": {"k": 2, "m": 3, "nodes": [str(n) for n in nodes]}}
            for steps in (2, STEPS):
                if steps == STEPS and rank == 0:
                    shutil.rmtree(nodes[1])
                ctx.barrier()
                _checkpoint_case(ctx, {"fsdp": 2, "tp": 2}, folder / "run_tp", steps, folder / "tp.pt", store)
            # the same checkpoint (step 3) resumed on another layout: fsdp 4, one more step
            _checkpoint_case(ctx, {"fsdp": 4}, folder / "run_tp", STEPS + 1, folder / "tp_to_fsdp4.pt", store)
        else:  # pp: the same round trip through the Trainer's pipeline
            for name, schedule in (("pp", "gpipe"), ("pp_interleaved", "interleaved_1f1b")):
                for steps in (2, STEPS):
                    pipelined = {"pp": 2, "schedule": schedule}
                    _checkpoint_case(ctx, pipelined, folder / f"run_{name}", steps, folder / f"{name}.pt")
            _auto_case(ctx, folder / "auto")
            for layout, parallel in (("fsdp", {"fsdp": 2}), ("pp", {"pp": 2, "schedule": "1f1b"})):
                _heal_case(ctx, parallel, folder / f"heal_{layout}")
    finally:
        ctx.destroy()


def _launch(world: int, folder: Path) -> None:
    spawn(_worker, world, (world, str(folder / f"rdzv{world}"), str(folder)))


def _reference(user: bool = False) -> list[dict[str, Any]]:
    """The unsplit model in one process: metrics and parameters after each step."""
    trainer = _trainer(_config({}), None, user=user)
    out = []
    for _ in range(STEPS):
        metrics = trainer.train_step()
        out.append({"loss": metrics["loss"], "norm": metrics["grad_norm"], "state": _full(trainer.model)})
    out[-1]["eval"] = trainer.evaluate()
    return out


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> Launched:
    folder = tmp_path_factory.mktemp("parallel")
    _launch(4, folder)
    _launch(2, folder)
    return folder, {False: _reference(), True: _reference(user=True)}


def _same_training(got: dict[str, Any], ref: list[dict[str, Any]], param_tol: dict[str, float]) -> None:
    torch.testing.assert_close(got["losses"], [r["loss"] for r in ref], **LOSS_TOL)
    torch.testing.assert_close(got["norms"], [r["norm"] for r in ref], **LOSS_TOL)
    want = ref[-1]["state"]
    assert set(got["state"]) == set(want)
    for name, tensor in want.items():
        torch.testing.assert_close(got["state"][name], tensor, **param_tol, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("name", [n for n in [*CASES_4, *CASES_2] if "bf16" not in n])
def test_layout_trains_as_the_unsplit_model(launched: Launched, name: str) -> None:
    folder, refs = launched
    ref = refs["user" in name]
    got = torch.load(folder / f"{name}.pt")
    _same_training(got, ref, PARAM_TOL)
    if "eval" in got:  # the Trainer's evaluation: each data-parallel share once, summed over them
        assert got["eval"].keys() == ref[-1]["eval"].keys()
        torch.testing.assert_close(got["eval"], ref[-1]["eval"], **PARAM_TOL)


@pytest.mark.parametrize(
    "name", [n for n in CASES_4 if n.startswith("trainer")] + ["trainer_pp2_gpipe", "tp2"]
)
def test_pipeline_steps_log_each_stage_compute_and_bubble(launched: Launched, name: str) -> None:
    per_rank = torch.load(launched[0] / f"{name}.pt")["pp"]  # [(busy s, bubble, fwd_bwd s) per step]
    if "pp" not in name:
        assert per_rank == [[], []]  # no pipeline, no pipeline figures
        return
    for steps in per_rank:
        assert len(steps) == STEPS
        for busy, bubble, fwd_bwd in steps:
            assert 0.0 < busy < fwd_bwd  # a stage computes part of the schedule's time, not all
            assert 0.0 < bubble < 1.0  # with m micro-batches on p stages every stage waits some


@pytest.mark.parametrize("layout", ["fsdp", "pp"])
def test_a_nan_is_rolled_back_by_healing_under_a_layout(launched: Launched, layout: str) -> None:
    run = RunDir(launched[0] / f"heal_{layout}")
    case = json.loads((run.path / "case.json").read_text())
    assert case == {"finite": True, "steps": HEAL_STEPS}
    rollbacks = [e for e in read_jsonl(run.events) if e.get("action") == "rollback"]
    assert len(rollbacks) == 1 and rollbacks[0]["evidence"]["to_step"] < NAN_AT
    rows = list(read_jsonl(run.metrics))
    bad = max(i for i, r in enumerate(rows) if not math.isfinite(r["loss"]))  # the NaN step, logged
    after = [r["step"] for r in rows[bad + 1 :]]  # retrained from the checkpoint rolled back to
    assert after == list(range(rollbacks[0]["evidence"]["to_step"] + 1, HEAL_STEPS + 1))
    assert all(math.isfinite(r["loss"]) for r in rows[bad + 1 :])
    if layout == "pp":  # the monitor's per-stage view, at its gather steps
        stages = [r["pp_stage_bubble"] for r in rows if "pp_stage_bubble" in r]
        assert stages and all(len(s) == 2 and all(0.0 < b < 1.0 for b in s) for s in stages)


def test_fsdp_bf16_compute_with_cpu_offload_stays_close(launched: Launched) -> None:
    folder, ref = launched[0], launched[1][False]
    got = torch.load(folder / "fsdp2_bf16_offload.pt")
    # bf16 parameters in forward and backward (8 bits of mantissa), fp32 master weights and reduction
    torch.testing.assert_close(got["losses"], [r["loss"] for r in ref], rtol=2e-2, atol=0.0)
    for name, tensor in ref[-1]["state"].items():
        torch.testing.assert_close(got["state"][name], tensor, rtol=0.0, atol=2e-3, msg=name)


def test_an_fsdp_tp_checkpoint_resumes_on_fsdp4(launched: Launched) -> None:
    folder, ref = launched[0], launched[1][False]
    loaded = torch.load(folder / "tp_to_fsdp4.pt")
    assert loaded["step"] == STEPS
    for name, tensor in ref[-1]["state"].items():  # fsdp 2 × tp 2's parameters after step 3, on fsdp 4
        torch.testing.assert_close(loaded["state"][name], tensor, **PARAM_TOL, msg=name)


def test_fsdp4_checkpoint_resumes_on_fsdp2(launched: Launched) -> None:
    folder, ref = launched[0], launched[1][False]
    saved, loaded = torch.load(folder / "loaded4.pt"), torch.load(folder / "loaded2.pt")
    assert saved["step"] == 0 and loaded["step"] == 2
    for name, tensor in ref[1]["state"].items():  # the parameters after step 2, resharded 4 → 2
        torch.testing.assert_close(loaded["state"][name], tensor, **PARAM_TOL, msg=name)


# fsdp 2 × tp 2 on 4 ranks (erasure-coded store, a node lost before the resume); pp 2 with gpipe, and
# with 2 stages per rank (interleaved_1f1b), on 2
@pytest.mark.parametrize("layout", ["tp", "pp", "pp_interleaved"])
def test_checkpoint_round_trip_resumes_exactly(launched: Launched, layout: str) -> None:
    folder, ref = launched[0], launched[1][False]
    loaded, end = torch.load(folder / f"{layout}.pt"), torch.load(folder / f"{layout}.end.pt")
    assert loaded["step"] == 2 and end["step"] == STEPS
    for name, tensor in ref[1]["state"].items():
        torch.testing.assert_close(loaded["state"][name], tensor, **PARAM_TOL, msg=name)
    for name, tensor in ref[-1]["state"].items():  # same layout: the same data order continues
        torch.testing.assert_close(end["state"][name], tensor, **PARAM_TOL, msg=name)


def test_auto_trains_on_the_chosen_layout_and_pins_it(launched: Launched) -> None:
    run = launched[0] / "auto"  # vatra.fit on 2 ranks with parallel.auto = true
    pinned = load_config(run / "config.toml").parallel
    assert not pinned.auto and pinned.size == 2
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 2 and math.isfinite(summary["final_loss"])
