"""The model, data and configs the vatra.parallel tests share: a small gpt (or a user's MLP) on
random tokens, every layout sized to the same global batch, so each trains as the unsplit model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import TensorDataset

from vatra.config import Config, config_from_dict
from vatra.data import DatasetSpec, ShardSampler
from vatra.engine import DistContext, Plugin, Trainer, seed_everything
from vatra.models import build_model

VOCAB, SEQ, STEPS, BATCH = 32, 8, 3, 8  # BATCH: samples per step over all data-parallel ranks
SPEC = DatasetSpec(kind="lm", input_shape=(SEQ,), num_classes=VOCAB)
LOSS_TOL = {"rtol": 1e-5, "atol": 1e-6}
PARAM_TOL = {"rtol": 1e-4, "atol": 1e-5}
Launched = tuple[Path, dict[bool, list[dict[str, Any]]]]  # results folder; references (gpt, user model)
CLIP = 0.5  # below the first steps' gradient norms: clipping over sharded gradients is exercised


def _config(parallel: dict[str, Any], **sections: dict[str, Any]) -> Config:
    raw: dict[str, Any] = {
        "run": {"progress": "off", "tensorboard": False},
        "model": {"name": "gpt", "n_layer": 4, "n_head": 4, "n_embd": 32},
        "train": {
            "steps": STEPS,
            "batch_size": BATCH,
            "eval_every": 0,
            "eval_batch_size": 5,
            "clip_grad_norm": CLIP,
        },
        "optim": {"name": "sgd", "lr": 0.1},
        "parallel": parallel,
    }
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    cfg = config_from_dict(raw)
    data_world = cfg.parallel.dp * cfg.parallel.fsdp
    cfg.train.batch_size = BATCH // data_world  # per rank: every layout trains on the same global batch
    return cfg


def _data(n: int = STEPS * BATCH, seed: int = 1) -> TensorDataset:
    tokens = torch.randint(0, VOCAB, (n, SEQ + 1), generator=torch.Generator().manual_seed(seed))
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])  # (N, T) inputs, next tokens as targets


def _val() -> TensorDataset:
    """22 samples in batches of 5: 4 ranks' strided shares (6, 6, 5, 5) take 2, 2, 1, 1 batches, so
    FSDP's collective forward needs the padded lockstep."""
    return _data(22, seed=2)


def _indices(data_rank: int, data_world: int) -> np.ndarray:
    """Data rank d's slice of every global batch: batch i = samples [i·BATCH, (i+1)·BATCH)."""
    glob = np.arange(STEPS * BATCH).reshape(STEPS, data_world, BATCH // data_world)
    return glob[:, data_rank, :].reshape(-1)


def _gpt(cfg: Config) -> torch.nn.Module:
    seed_everything(0)  # the same initial weights on every rank and in the reference
    return build_model(cfg.model, SPEC)


USER_PLAN = {"1": "colwise", "3": "rowwise"}  # a user's model: its MLP split by parallel.tp_plan


def _user_model(cfg: Config) -> torch.nn.Module:
    seed_everything(0)
    width = cfg.model.n_embd
    return torch.nn.Sequential(
        torch.nn.Embedding(VOCAB, width),  # (B, T) → (B, T, C)
        torch.nn.Linear(width, 4 * width),  # colwise: (B, T, 4C / tp) on each rank
        torch.nn.GELU(),
        torch.nn.Linear(4 * width, width),  # rowwise: partial sums all-reduced to (B, T, C)
        torch.nn.Linear(width, VOCAB),
    )


def _trainer(
    cfg: Config,
    ctx: DistContext | None,
    plugins: list[Plugin] | None = None,
    user: bool = False,
    **kw: Any,
) -> Trainer:
    par = cfg.parallel
    rank = ctx.rank if ctx is not None else 0
    sampler = ShardSampler(
        _indices(par.data_rank(rank), par.dp * par.fsdp), cfg.train.batch_size, seed=0, shuffle=False
    )
    model = _user_model(cfg) if user else _gpt(cfg)
    return Trainer(cfg, model, _data(), _val(), SPEC, sampler, dist=ctx, plugins=plugins or [], **kw)
