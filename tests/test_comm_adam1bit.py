"""1-bit Adam (``vatra.comm.adam1bit``) on 2 gloo ranks against a reference written here from the
paper's equations (Tang et al., 2021, Algorithm 1 with its compressed all-reduce), step by step
through the warm-up and the switch; and the Adam path left alone with ``comm.method = "none"``."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from tests._dist import rewind, spawn, train_ranks
from tests.conftest import small_config

from vatra.comm._base import Ctx
from vatra.comm.adam1bit import VarianceWatch
from vatra.comm.hooks import TensorDraws
from vatra.comm.int8 import Int8
from vatra.comm.minifloat import FP4_LEVELS, Fp4Blocks, Fp8Rows
from vatra.comm.plugin import CommPlugin
from vatra.comm.topk import TopK
from vatra.config import Config
from vatra.engine import DistContext, Plugin, Trainer
from vatra.rundir import read_jsonl

WORLD = 2
STEPS = 20
FREEZE = 8  # comm.start_step: 8 full-precision Adam steps, then 12 compressed ones
MIN_NUMEL = 64  # the biases (32 and 10 elements) travel as an exact average, the matrices compressed


def _onebit(x: torch.Tensor) -> torch.Tensor:
    """sign(x)·mean|x| per row of a 2-D chunk, per chunk when flat (a sign of 0 is +)."""
    scale = x.abs().mean(dim=-1, keepdim=True)
    return torch.where(x >= 0, scale, -scale)


def _topk(ratio: float) -> Any:
    """Per block of 256 values (the flat chunk padded with zeros) its ⌈256·ratio⌉ largest |values|;
    the kept values in fp8 (e4m3) with one scale for the chunk, their largest |value| / 448."""

    def compress(x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1)
        k = math.ceil(ratio * 256)
        rows = torch.nn.functional.pad(flat, (0, -flat.numel() % 256)).view(-1, 256)
        idx = rows.abs().topk(k, dim=1).indices
        values = rows.gather(1, idx)
        scale = values.abs().amax().clamp_min(torch.finfo(torch.float32).tiny) / 448.0
        kept = torch.zeros_like(rows).scatter_(
            1, idx, (values / scale).to(torch.float8_e4m3fn).float() * scale
        )
        return kept.reshape(-1)[: flat.numel()].view_as(x)

    return compress


def _fp8(x: torch.Tensor) -> torch.Tensor:
    """Round to float8 e4m3 with a scale per row (amax / 448) of a 2-D chunk, one scale when flat."""
    rows = x.reshape(x.shape[0] if x.dim() >= 2 else 1, -1)
    scale = rows.abs().amax(dim=1, keepdim=True) / 448.0
    q = (rows / scale.clamp_min(torch.finfo(torch.float32).tiny)).clamp(-448, 448).to(torch.float8_e4m3fn)
    return (q.float() * scale).view_as(x)


def _chunks(t: torch.Tensor) -> list[torch.Tensor]:
    """Rank j serves chunk j: blocks of whole rows of a matrix, else pieces of the flat tensor."""
    if t.dim() >= 2 and t.shape[0] >= WORLD:
        return list(t.reshape(t.shape[0], -1).tensor_split(WORLD))
    return list(t.reshape(-1).tensor_split(WORLD))


class Reference:
    """1-bit Adam from the equations, for every rank at once (it is given all ranks' gradients).

    Warm-up (t < T₀): ḡ = the gᵢ's mean, per chunk j: Q(mean_i Q(gᵢⱼ)) with Q fp8 (e4m3) per row (small
    tensors: the mean of the gᵢ in fp16), m ← β₁m + (1−β₁)ḡ, v ← β₂v + (1−β₂)ḡ²,
    x ← x(1 − ηλ) − η·m/(1−β₁ᵗ) / (√v/√(1−β₂ᵗ) + ε) (AdamW). At T₀: v̂ = v/(1−β₂^T₀), frozen.
    Compressed: mᵢ = β₁m + (1−β₁)gᵢ, uᵢ = clip(mᵢ/(√v̂+ε), ±B); per chunk j: cᵢⱼ = C(uᵢ + eᵢ)ⱼ,
    eᵢ ← uᵢ + eᵢ − cᵢ; server j: aⱼ = mean_i cᵢⱼ + sⱼ, ĉⱼ = C(aⱼ), sⱼ ← aⱼ − ĉⱼ; ū = (ĉⱼ)ⱼ,
    m ← ū(√v̂+ε), x ← x(1 − ηλ) − η·m/(1−β₁ᵗ)/(√v̂+ε). Small tensors: ū = mean of the uᵢ (fp16)."""

    def __init__(self, params: dict[str, torch.Tensor], compress: Any, cfg: Config) -> None:
        self.x = {n: p.detach().clone() for n, p in params.items()}
        self.m = {n: torch.zeros_like(p) for n, p in self.x.items()}
        self.v = {n: torch.zeros_like(p) for n, p in self.x.items()}
        self.e = {(n, i): torch.zeros_like(p) for n, p in self.x.items() for i in range(WORLD)}
        self.s = {(n, j): torch.zeros_like(c) for n, p in self.x.items() for j, c in enumerate(_chunks(p))}
        self.compress, self.cfg = compress, cfg
        self.index = {n: i for i, n in enumerate(params)}  # the parameter's position: its draws' seed
        self.b1, self.b2, self.eps = 0.9, 0.999, 1e-8
        self.wd = cfg.optim.weight_decay
        self.bound = (1 - self.b1) / math.sqrt((1 - self.b2) * (1 - self.b1**2 / self.b2))
        self.t = 0

    def step(self, grads: list[dict[str, torch.Tensor]], lr: float) -> None:
        self.t += 1
        t, b1, b2, eps = self.t, self.b1, self.b2, self.eps
        if t == FREEZE + 1:
            for n in self.v:
                self.v[n] = self.v[n] / (1 - b2**FREEZE)
        for n, x in self.x.items():
            x.mul_(1 - lr * self.wd)
            if t <= FREEZE:
                if x.numel() < MIN_NUMEL or self.cfg.comm.warmup_precision == "fp16":
                    g = sum(gi[n].half() for gi in grads).float() / WORLD  # type: ignore[union-attr]
                else:
                    g = self._fp8_average([gi[n] for gi in grads])
                self.m[n] = b1 * self.m[n] + (1 - b1) * g
                self.v[n] = b2 * self.v[n] + (1 - b2) * g * g
                denom = self.v[n].sqrt() / math.sqrt(1 - b2**t) + eps
            else:
                denom = self.v[n].sqrt() + eps
                u = [
                    ((b1 * self.m[n] + (1 - b1) * gi[n]) / denom).clamp(-self.bound, self.bound)
                    for gi in grads
                ]
                if x.numel() < MIN_NUMEL:
                    avg = sum(ui.half() for ui in u).float() / WORLD  # type: ignore[union-attr]
                elif self.cfg.comm.method == "randomk":
                    avg = self._int8_average(n, u)
                elif self.cfg.comm.method == "topk":
                    avg = self._gathered_average(n, u)
                else:
                    avg = self._compressed_average(n, u)
                self.m[n] = avg * denom
            x.addcdiv_(self.m[n], denom, value=-lr / (1 - b1**t))

    def _fp8_average(self, g: list[torch.Tensor]) -> torch.Tensor:
        served = []
        for j in range(WORLD):
            total = sum(_fp8(_chunks(gi)[j]) for gi in g)
            served.append(_fp8(total / WORLD).reshape(-1))  # type: ignore[operator]
        return torch.cat(served).view_as(g[0])

    def _int8_average(self, name: str, u: list[torch.Tensor]) -> torch.Tensor:
        """Random-k: every rank keeps xᵢ = uᵢ + eᵢ at the same k indices (drawn as the hook seeds its
        draws: run.seed, rank 0 for all, the step, the parameter's position); s = Σᵢ max|xᵢ[idx]| /
        (127 − W); qᵢ = round(xᵢ[idx] / s) summed as int8, exactly; eᵢ ← xᵢ − qᵢ·s; ū = Σqᵢ·s / W."""
        draws = TensorDraws(self.cfg.run.seed, 0, {0: self.index[name]}, torch.device("cpu"))
        draws.reseed(0, self.t - 1)  # the hook's step: steps done before this one
        numel = u[0].numel()
        idx = torch.randperm(numel, generator=draws.generator)[: math.ceil(self.cfg.comm.ratio * numel)]
        xs = [(ui + self.e[name, i]).reshape(-1) for i, ui in enumerate(u)]
        values = [x[idx] for x in xs]
        s = float((values[0].abs().amax() + values[1].abs().amax()) / (127 - WORLD))
        qs = [torch.round(v / s).to(torch.int8) for v in values]
        for i, (x, q) in enumerate(zip(xs, qs, strict=True)):
            self.e[name, i] = (x - torch.zeros_like(x).index_put_((idx,), q.float() * s)).view_as(u[i])
        total = qs[0] + qs[1]  # no overflow: |q₀| + |q₁| ≤ 127 − W + 1
        return torch.zeros_like(xs[0]).index_put_((idx,), total.float() * (s / WORLD)).view_as(u[0])

    def _gathered_average(self, name: str, u: list[torch.Tensor]) -> torch.Tensor:
        """top-k on 2 ranks: each rank's cᵢ = C(uᵢ + eᵢ) of the whole tensor goes to the other,
        eᵢ ← uᵢ + eᵢ − cᵢ, ū = the cᵢ's mean (no server cut, so no server error)."""
        sent = []
        for i, ui in enumerate(u):
            xi = ui + self.e[name, i]
            sent.append(self.compress(xi))
            self.e[name, i] = xi - sent[-1]
        return sum(sent) / WORLD  # type: ignore[return-value]

    def _compressed_average(self, name: str, u: list[torch.Tensor]) -> torch.Tensor:
        sent = []
        for i, ui in enumerate(u):
            xi = ui + self.e[name, i]
            ci = [self.compress(c) for c in _chunks(xi)]
            self.e[name, i] = xi - torch.cat([c.reshape(-1) for c in ci]).view_as(xi)
            sent.append(ci)
        out = []
        for j in range(WORLD):
            a = sum(sent[i][j] for i in range(WORLD)) / WORLD + self.s[name, j]
            c = self.compress(a)
            self.s[name, j] = a - c
            out.append(c.reshape(-1))
        return torch.cat(out).view_as(u[0])


class _Compare(Plugin):
    """Placed after the comm plugin: captures this rank's own gradients (tensor hooks fire before
    DDP averages them), steps the reference with every rank's, and compares after each update."""

    def __init__(self, compress: Any, cfg: Config) -> None:
        self.compress, self.cfg = compress, cfg
        self.local: dict[str, torch.Tensor] = {}
        self.worst = 0.0
        self.bytes: list[int] = []
        self.events: list[dict[str, Any]] = []

    def on_fit_start(self, trainer: Trainer) -> None:
        params = dict(trainer.model.named_parameters())
        self.ref = Reference(params, self.compress, self.cfg)
        for name, p in params.items():
            p.register_hook(lambda g, name=name: self.local.__setitem__(name, g.detach().clone()))

    def on_step_start(self, trainer: Trainer) -> None:
        self.lr = trainer.optimizer.param_groups[0]["lr"]

    def after_update(self, trainer: Trainer) -> None:
        grads: list[dict[str, torch.Tensor]] = [{} for _ in range(WORLD)]
        for name in sorted(self.local):
            parts = [torch.empty_like(self.local[name]) for _ in range(WORLD)]
            dist.all_gather(parts, self.local[name])
            for i in range(WORLD):
                grads[i][name] = parts[i]
        self.ref.step(grads, self.lr)
        for name, p in trainer.model.named_parameters():
            # the same arithmetic in another order (torch's foreach Adam, fused buffers): float
            # rounding, compounded over 20 steps; a sign or top-k choice that flipped would be ~1e-3.
            # A bias's uᵢ travels in fp16, where a last-bit difference upstream can round one value
            # to its neighbouring half once: lr·ulp(u)/2, up to ~3e-5 (2.5e-6 seen)
            small = p.numel() < MIN_NUMEL
            got, want = p.detach(), self.ref.x[name]
            if self.ref.t > FREEZE:
                # an element no gradient reached in the warm-up (a blank digits pixel) has v̂ = 0, so
                # uᵢ = β₁m/ε turns m's rounding (~1e-10) into ± the bound: its sign, and so its step,
                # is a rounding of nothing, which the two implementations take differently on some
                # CPUs (AMD EPYC: 30 such elements of one row, a step's size apart). Every element a
                # gradient reached in the warm-up is compared: 79 % of the first layer's weights (the
                # digits' blank pixels, 2 hidden units that never fire), 94 % of its bias and of the
                # head's weights
                live = self.ref.v[name] > 0
                assert int(live.sum()) >= 0.75 * live.numel(), f"{name}: {int(live.sum())} elements live"
                got, want = got[live], want[live]
            torch.testing.assert_close(
                got,
                want,
                rtol=1e-5,
                atol=5e-5 if small else 1e-6,
                msg=lambda m, name=name: f"{self.cfg.comm.method} step {self.ref.t}, {name}: {m}",
            )

    def on_step_end(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        self.bytes.append(metrics["comm_bytes"])

    def on_event(self, trainer: Trainer, kind: str, fields: dict[str, Any]) -> None:
        if kind == "compression_started":
            self.events.append(fields)


class _Bytes(Plugin):
    def __init__(self) -> None:
        self.bytes: list[int] = []

    def on_step_end(self, trainer: Trainer, metrics: dict[str, Any]) -> None:
        self.bytes.append(metrics["comm_bytes"])


def _config(method: str, **comm: Any) -> Config:
    return small_config(
        train={"steps": STEPS, "batch_size": 16},
        optim={"name": "adamw", "lr": 0.01, "weight_decay": 0.05, "schedule": "cosine", "warmup_steps": 3},
        dist={"bucket_cap_mb": 0.004},  # several DDP buckets
        comm={"method": method, "start_step": FREEZE, "min_numel": MIN_NUMEL, **comm},
    )


def _params(trainer: Trainer) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in trainer.model.parameters()])


def _worker(rank: int, init_file: str, out: str) -> None:
    torch.set_num_threads(1)
    ctx = DistContext.init(
        small_config().dist, rank=rank, world_size=WORLD, init_method=f"file://{init_file}"
    )
    results: dict[str, Any] = {}
    try:
        cases = (
            ("onebit", _onebit, "fp8", 0.02),
            ("topk", _topk(0.02), "fp8", 0.02),
            ("randomk", None, "fp8", 0.25),
            ("onebit", _onebit, "fp16", 0.02),
        )
        for method, compress, warm, ratio in cases:
            cfg = _config(method, ratio=ratio, onebit_scale="row", sparsity_warmup=0, warmup_precision=warm)
            compare = _Compare(compress, cfg)
            trainer = Trainer.from_config(cfg, dist=ctx, plugins=[CommPlugin(cfg.comm), compare])
            summary = trainer.fit()
            name = method if warm == "fp8" else f"{method}-{warm}"
            results[name] = {"bytes": compare.bytes, "events": compare.events, "summary": summary}
        # the fp4 warm-up (the default): its rounding is random, so no reference; every rank must
        # still apply the same average (every rank decodes the same served chunks)
        cfg = _config("onebit", ratio=0.02, onebit_scale="row", warmup_precision="fp4")
        sent = _Bytes()
        trainer = Trainer.from_config(cfg, dist=ctx, plugins=[CommPlugin(cfg.comm), sent])
        trainer.fit()
        mine = _params(trainer)
        both = [torch.empty_like(mine) for _ in range(WORLD)]
        dist.all_gather(both, mine)
        results["onebit-fp4"] = {"bytes": sent.bytes, "ranks_equal": torch.equal(both[0], both[1])}
        # comm.method = "none": DDP's own all-reduce and torch's AdamW, bit for bit as without vatra's plugin
        cfg = _config("none")
        plain = Trainer.from_config(cfg, dist=ctx)
        plain.fit()
        hooked = Trainer.from_config(cfg, dist=ctx, plugins=[CommPlugin(cfg.comm)])
        hooked.fit()
        results["none_equal"] = torch.equal(_params(plain), _params(hooked))
        results["none_optimizer"] = type(hooked.optimizer) is torch.optim.AdamW
        if rank == 0:
            Path(out).write_text(json.dumps(results, default=str))
    finally:
        ctx.destroy()


@pytest.mark.slow(9)
def test_onebit_adam_equals_the_reference_step_by_step(tmp_path: Path) -> None:
    # Prepare
    out = tmp_path / "results.json"
    # Execute: the reference comparison runs inside every rank, after every step
    spawn(_worker, WORLD, (str(tmp_path / "rdzv"), str(out)))
    # Assert
    r = json.loads(out.read_text())
    numel = {"trunk.0.weight": 32 * 64, "trunk.0.bias": 32, "head.weight": 10 * 32, "head.bias": 10}
    rows = {"trunk.0.weight": 32, "head.weight": 10}
    for method in ("onebit", "topk", "randomk", "onebit-fp16"):
        sent = r[method]["bytes"]
        assert r[method]["summary"]["compression_started_step"] == FREEZE
        assert [e["step"] for e in r[method]["events"]] == [FREEZE]
        assert "comm.start_step" in r[method]["events"][0]["reason"]
        # warm-up: a matrix's gradient in fp8 with a 4-byte scale per row: half to its server, the
        # served half back (2 ranks: one fp8 copy); the biases in fp16, a 2-rank all-reduce sends half
        # (comm.warmup_precision = "fp16": all of them in fp16)
        warm = sum(n + 4 * rows[k] for k, n in numel.items() if k in rows) + 2 * 42
        assert sent[:FREEZE] == [2 * sum(numel.values()) if "fp16" in method else warm] * FREEZE
        assert len(set(sent[FREEZE:])) == 1
    # compressed (2 ranks): one chunk's payload to its server, the served chunk's to the other
    # rank = one compressed copy; the biases' u in fp16
    onebit = sum(math.ceil(n / 2 / 8) * 2 + 4 * rows[k] for k, n in numel.items() if k in rows)
    assert r["onebit"]["bytes"][FREEZE] == onebit + 2 * 42
    # top-k (2 ranks: the whole tensor's payload to the other rank): per block of 256, ⌈0.02·256⌉ = 6
    # one-byte places and fp8 values, and one fp32 scale
    topk = sum(math.ceil(n / 256) * 6 * 2 + 4 for k, n in numel.items() if k in rows)
    assert r["topk"]["bytes"][FREEZE] == topk + 2 * 42
    # random-k: only the values at the shared indices, summed in int8, and each tensor's scale (a
    # float): a 2-rank all-reduce sends one copy
    randomk = sum(math.ceil(0.25 * n) + 4 for k, n in numel.items() if k in rows)
    assert r["randomk"]["bytes"][FREEZE] == randomk + 2 * 42
    # fp4 warm-up: per chunk half a byte a value and a bf16 scale per 32 values (trunk.0.weight's
    # chunks: 1,024 values; head.weight's: 160); both ranks end with the same parameters
    fp4 = r["onebit-fp4"]
    warm = 2 * (512 + 2 * 32) + 2 * (80 + 2 * 5) + 2 * 42
    assert fp4["bytes"][:FREEZE] == [warm] * FREEZE and fp4["bytes"][FREEZE] == onebit + 2 * 42
    assert fp4["ranks_equal"]
    assert r["none_equal"] and r["none_optimizer"]


def test_variance_watch_freezes_a_settled_second_moment_and_not_a_rising_one() -> None:
    """Synthetic second moments (β₂ = 0: v̂ is the last squared gradient): one still growing by 5 %
    a step is never frozen; one that levels off is frozen once it moved by under 2 % a step for the
    window; one that falls by 3 % a step after its peak is frozen a window after the peak; nothing is
    frozen in the LR warm-up."""

    def run(norms: list[float], after: int = 10) -> tuple[int | None, str]:
        watch = VarianceWatch(tol=0.02, window=15, after=after)
        p = torch.nn.Parameter(torch.zeros(4))
        opt = torch.optim.AdamW([p], betas=(0.9, 0.0))
        for step, n in enumerate(norms, 1):
            p.grad = torch.full((4,), math.sqrt(n))  # ‖v̂‖ = 2n
            opt.step()
            if watch.settled(opt, step):
                return step, watch.why
        return None, ""

    rising = [1.05**k for k in range(100)]
    assert run(rising) == (None, "")
    # the first step off the slope still moved by 5.5 %; 15 calm steps follow
    level = [1.05**k for k in range(30)] + [1.05**30 * (1 + 0.005 * (-1) ** k) for k in range(60)]
    step, why = run(level)
    assert step == 30 + 1 + 15 and "less than 2%" in why
    falling = [1.05**k for k in range(30)] + [1.05**29 * 0.97**k for k in range(1, 60)]
    step, why = run(falling)
    assert step == 30 + 15 and "past its peak" in why
    assert run(falling, after=70)[0] == 70 + 15  # highs count from the end of the LR warm-up
    # so do calm steps, the move into step 30 the first (gpt_text froze at step 30: −11 points)
    assert run([1.0] * 60, after=30)[0] == 30 + 14


RESUME = [
    *("train.steps=16", "train.eval_every=0", "model.hidden=[32]", "optim.warmup_steps=0"),
    *("comm.method=onebit", "comm.start_step=4", "checkpoint.every_steps=4"),
    *("monitor.enabled=false", "heal.enabled=false", "run.tensorboard=false", "run.progress=off"),
]


@pytest.mark.slow(25)
def test_a_resumed_onebit_adam_run_repeats_the_uninterrupted_one(tmp_path: Path) -> None:
    # Prepare: digits' AdamW, frozen after step 4, checkpoints every 4 steps; a copy rewound to step 8
    run, again = tmp_path / "run", tmp_path / "again"
    summary = train_ranks(run, *RESUME)
    done = rewind(run, again, step=8)
    # Execute: train the copy again from step 8
    train_ranks(again, *RESUME)
    # Assert: the same losses at steps 9-16 (the freeze, the momentum, both sides' residuals were
    # restored; a run that restarted its warm-up or its residuals differs from step 9 on)
    assert summary["compression_started_step"] == 4
    lines = read_jsonl(again / "metrics.jsonl")
    before = {m["step"]: m["loss"] for m in lines[:done]}
    after = {m["step"]: m["loss"] for m in lines[done:]}
    assert sorted(after) == list(range(9, 17))
    assert all(after[s] == before[s] for s in after), (before, after)


def test_the_fp8_warm_up_keeps_a_rows_small_gradients_and_refuses_a_malformed_payload() -> None:
    # Prepare: a row whose values span six decades, and one of zeros
    grad = torch.stack([torch.logspace(-5, 0, 64) * torch.tensor([1.0, -1.0]).repeat(32), torch.zeros(64)])
    fp8, int8 = Fp8Rows(), Int8()
    # Execute
    payload, ctx = fp8.compress(grad)
    back = fp8.decompress(payload, ctx)
    # Assert: one byte a value and 4 a row's scale; within e4m3's 1/16 down to ~1e-4 of the row's
    # largest, where int8 (the same bytes) has rounded to 0 all under 1/254 of it
    assert sum(t.numel() * t.element_size() for t in payload) == 128 + 2 * 4
    kept = grad[0].abs() > 1e-4
    assert ((back[0] - grad[0]).abs() <= grad[0].abs() / 16)[kept].all() and (back[1] == 0).all()
    assert (int8.decompress(*int8.compress(grad))[0][grad[0].abs() < 1 / 254] == 0).all()
    # a payload that does not fit the tensor is refused, not read
    with pytest.raises(ValueError, match="fp8 payload"):
        fp8.decompress([payload[0][:-1], payload[1]], ctx)
    with pytest.raises(ValueError, match="fp8 payload"):
        fp8.decompress([payload[0], payload[1][:1]], ctx)
    with pytest.raises(ValueError, match="fp8 payload"):
        fp8.decompress([payload[0].view(torch.int8), payload[1]], Ctx(ctx.shape, ctx.dtype))
    # the receiver sizes the buffers from its own shapes, so a peer controls only the bytes: any
    # bytes of those sizes decode to a tensor of the shape (0x7f/0xff are e4m3's NaN: a non-finite
    # gradient, which training already stops or skips on)
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        raw = torch.randint(0, 256, (128 + 8,), dtype=torch.uint8, generator=gen)
        values, scales = raw[:128], raw[128:].view(torch.float32)
        assert fp8.decompress([values, scales], ctx).shape == grad.shape


def test_the_fp4_warm_up_rounds_without_bias_and_refuses_a_malformed_payload() -> None:
    # Prepare: values over six decades in blocks of 32 (n = 70: the last block is padded), a block
    # of zeros, and the generator the hook would seed
    grad = torch.cat([torch.logspace(-6, 0, 64) * torch.tensor([1.0, -1.0]).repeat(32), torch.zeros(6)])
    fp4 = Fp4Blocks()
    fp4.generator = torch.Generator().manual_seed(0)
    # Execute: 4,000 roundings of the same gradient
    payload, ctx = fp4.compress(grad)
    mean = sum(fp4.decompress(*fp4.compress(grad)) for _ in range(4000)) / 4000
    # Assert: half a byte a value and a bf16 scale per block of 32; every value decodes to one of the
    # 16 levels times its block's scale, signs kept; the mean of the roundings is the value (within
    # the binomial spread of 4,000 draws: a level step is at most 2·scale), including values far
    # under the block's smallest step, which round-to-nearest would leave at 0
    assert [t.numel() * t.element_size() for t in payload] == [35, 2 * 3]
    back = fp4.decompress(payload, ctx)
    assert (back * grad >= 0).all() and (back[64:] == 0).all()
    scale = payload[1].float().repeat_interleave(32)[:70]
    assert (
        ((back.abs() / scale.clamp_min(1e-30)).unsqueeze(1) == torch.tensor(FP4_LEVELS)).any(dim=1)[:64].all()
    )
    tiny = grad.abs() < scale * 0.25  # under half the smallest step: round-to-nearest gives 0
    assert tiny.sum() > 10 and (mean[tiny] != 0).all()
    assert ((mean - grad).abs() <= 4 * 2 * scale / 4000**0.5).all()
    # any bytes a peer sends decode (a random scale may be inf or NaN: a non-finite gradient); a
    # payload of the wrong length is refused in one line
    for _ in range(50):
        junk = [torch.randint(0, 256, (35,), dtype=torch.uint8), torch.randn(3).to(torch.bfloat16)]
        assert fp4.decompress(junk, ctx).shape == grad.shape
    with pytest.raises(ValueError, match="fp4 payload of 34"):
        fp4.decompress([payload[0][:34], payload[1]], ctx)


def test_block_top_k_keeps_each_blocks_largest_in_fp8_with_one_byte_places() -> None:
    # Prepare: 600 values (3 blocks of 256, the last padded), the largest 5 % of each block known
    torch.manual_seed(0)
    x = torch.randn(20, 30)
    topk = TopK(0.05)
    topk.block, topk.value_dtype = 256, torch.float8_e4m3fn
    # Execute
    payload, ctx = topk.compress(x)
    back = topk.decompress(payload, ctx)
    # Assert: ⌈0.05·256⌉ = 13 places (a byte each) and fp8 values per block, one fp32 scale; what
    # comes back is each block's 13 largest |values| (the padded block: its 88 values and zeros),
    # each within e4m3's rounding
    assert [t.numel() * t.element_size() for t in payload] == [39, 39, 4]
    flat, out = x.reshape(-1), back.reshape(-1)
    for b in range(3):
        block = flat[256 * b : 256 * (b + 1)]
        want = block.abs().topk(min(13, block.numel())).indices + 256 * b
        assert set(out.nonzero().squeeze(1)[(out.nonzero().squeeze(1) // 256) == b].tolist()) == set(
            want.tolist()
        )
    kept = out != 0
    assert ((out[kept] - flat[kept]).abs() <= flat[kept].abs() / 16).all()
    # without fp8 the kept values travel as they are (no scale)
    topk.value_dtype = None
    plain = topk.decompress(*topk.compress(x)).reshape(-1)
    assert torch.equal(plain != 0, kept) and torch.equal(plain[kept], flat[kept])
    topk.value_dtype = torch.float8_e4m3fn
    # places are bytes, so any bytes decode inside the tensor; a short payload is refused
    junk = [
        torch.randint(0, 256, (39,), dtype=torch.uint8),
        torch.randint(0, 256, (39,), dtype=torch.uint8),
        torch.ones(1),
    ]
    assert topk.decompress(junk, ctx).shape == x.shape
    with pytest.raises(ValueError, match="block payload of 38 places"):
        topk.decompress([payload[0][:38], *payload[1:]], ctx)
