"""GPU checks, in one short run (a device is lent to some sessions only; no test needs one).

    python bench/gpu_check.py                 (CUDA; ~7 min on an H200, estimated: not yet run on one)
    python bench/gpu_check.py --smoke         (any machine: tiny models on the CPU, checks the script)

1. ``precision`` (~3 min): fp32, bf16 and fp16 for a 12-layer ``gpt`` (autocast, FP32 master weights,
   fp16 with the gradient scaler) through vatra's Trainer on the ``text`` source, in a rotating order:
   median step time after a warm-up, peak memory (``torch.cuda.max_memory_allocated``), and the loss
   after the same steps. The seed's claims to test: memory −50 %, up to 3× faster.
2. ``throughput`` (~3 min, most of it compiling): the largest ``gpt`` of a ladder (0.3 B–6.4 B
   parameters, byte-level vocabulary of 256 as the ``text`` source has) whose estimated training
   memory fits the GPU's free memory, one size down when it runs out of memory anyway. Plain PyTorch
   (``torch.compile``, bf16 autocast, fused AdamW, one fixed batch of random tokens on the GPU) against
   vatra's Trainer (``train.compile``, ``train.precision = "bf16"``, the same model and batch shape, its
   AdamW: fused on CUDA as vatra builds it): median tokens/s after a warm-up (the first step compiles),
   their ratio (target ≥ 0.98) and the MFU of each. The Trainer reads the ``text`` source through its
   own loader (batched fetch, read-ahead thread, copy to the GPU): that data path is part of what a
   user gets. It runs without plugins (``train_step`` writes no metrics; what ``vatra train``'s writers
   cost is ``bench/trainer_overhead.py``'s measure).
3. ``fsdp`` (~20 s): a one-rank process group on NCCL (gloo with ``--smoke``), a small ``gpt`` sharded
   with ``vatra.parallel.apply_fsdp`` over a ``Mesh`` (the Trainer shards only when dp × fsdp > 1, so
   the API is called directly), a few AdamW steps on one batch: the loss must be finite, fall, and
   start where an unsharded copy's does (rtol 1e-5: the same weights and kernels, gathered from one
   shard).
4. ``energy`` (~2 min, ``bench/gpu_energy.py``): a Zeus-style search over batch size (and, with
   ``--energy-set-limits``, power limit): NVML's energy and the time to a target loss for each pair,
   the pair with the least η·energy + (1 − η)·max power·time; on the CPU the labelled estimate.

MFU = tokens/s × flops per token / peak, with PaLM's flops per token 6·N + 12·n_layer·n_embd·seq
(Chowdhery et al. 2022, appendix B), N the parameters that take part in a matmul: all but the position
embedding (the tied token embedding counts once, as the head). Peak: dense bf16 of the device
(``PEAK_BF16``), or ``--peak-tflops``.
"""

from __future__ import annotations

import argparse
import copy
import gc
import math
import os
import statistics
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn import functional as F

import gpu_energy
from _common import print_table, write_result
from vatra.config import DistConfig, ModelConfig, ParallelConfig, config_from_dict
from vatra.data import DatasetSpec
from vatra.engine import DistContext, Trainer
from vatra.launch import free_port
from vatra.models import build_model
from vatra.parallel import Mesh, apply_fsdp

VOCAB = 256  # the text source's bytes

# Dense bf16 FLOP/s (no sparsity), first match in torch.cuda.get_device_name().
PEAK_BF16 = (("H200", 989e12), ("H100 PCIe", 756e12), ("H100", 989e12), ("A100", 312e12))
SMOKE_PEAK = 1e12  # a pretend peak: the smoke run checks the arithmetic, not the CPU

# Training memory per parameter: fp32 weights and gradients (4 + 4), AdamW's two fp32 moments (8), the
# bf16 copies autocast makes of the weights and backward keeps (2), and the temporaries of torch's
# default (foreach) AdamW step: about one fp32 tensor per parameter (4; the fused step vatra uses on CUDA
# needs less, so the estimate errs large).
BYTES_PER_PARAM = 22
# Activations kept for backward per layer and token, in units of n_embd: 34 bytes in bf16 without the
# attention scores, which scaled_dot_product_attention does not store (Korthikanti et al. 2022).
ACTIVATION_BYTES = 34
LOGIT_BYTES = 10  # per token and vocabulary entry: bf16 logits, their fp32 copy and log-softmax
MARGIN = 1.15  # fragmentation, the allocator's cache, compiled kernels' workspaces


@dataclass(frozen=True)
class Size:
    n_layer: int
    n_head: int
    n_embd: int

    def __str__(self) -> str:
        return f"{self.n_layer} × {self.n_embd}, {self.n_head} heads"


# GPT-3's depths and widths for 350M, 760M, 1.3B, 2.7B and 6.7B (Brown et al. 2020, table 2.1), heads
# of 64–128 dimensions.
LADDER = (Size(24, 16, 1024), Size(24, 16, 1536), Size(24, 16, 2048), Size(32, 32, 2560), Size(32, 32, 4096))
SMOKE_LADDER = (Size(1, 2, 32), Size(2, 2, 64), Size(2, 4, 128))
SMOKE_FREE_BYTES = 8 * 2**20  # a pretend free memory between the smoke ladder's 2nd and 3rd estimates


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def release(device: torch.device) -> None:
    """Free what the last run held: dynamo's caches, reference cycles, the allocator's cached blocks."""
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def timed(step: Callable[[], Any], steps: int, warmup: int, device: torch.device) -> list[float]:
    """Seconds of each of ``warmup + steps`` calls of ``step``, the device synchronised around each."""
    times = []
    for _ in range(warmup + steps):
        sync(device)
        t0 = time.perf_counter()
        step()
        sync(device)
        times.append(time.perf_counter() - t0)
    return times


# ---------------------------------------------------------------------------------- 1. precision
def gpt_config(precision: str, smoke: bool, steps: int) -> dict[str, Any]:
    size = (
        {"n_layer": 2, "n_head": 2, "n_embd": 64} if smoke else {"n_layer": 12, "n_head": 12, "n_embd": 768}
    )
    return {
        "run": {"progress": "off", "tensorboard": False},
        "data": {"name": "text", "block_size": 64 if smoke else 256, "max_chars": 200_000},
        "model": {"name": "gpt", "dropout": 0.0, **size},
        "train": {"steps": steps, "batch_size": 8 if smoke else 32, "eval_every": 0, "precision": precision},
        "optim": {"name": "adamw", "lr": 3e-4},
        "monitor": {"enabled": False},
        "checkpoint": {"enabled": False},
    }


def run_precision(
    precision: str, smoke: bool, steps: int, warmup: int, device: torch.device
) -> dict[str, Any]:
    cfg = config_from_dict(gpt_config(precision, smoke, steps))
    trainer = Trainer.from_config(cfg, dist=DistContext(device=device))
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times, loss = [], float("nan")
    for step in range(steps):
        t0 = time.perf_counter()
        metrics = trainer.train_step()
        sync(device)
        if step >= warmup:
            times.append(time.perf_counter() - t0)
        loss = metrics["loss"]
    peak = torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else float("nan")
    fp32 = all(p.dtype == torch.float32 for p in trainer.model.parameters())
    trainer.batches.close()
    return {"s_per_step": statistics.median(times), "peak_mb": peak, "final_loss": loss, "fp32_weights": fp32}


def check_precision(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    precisions = ["fp32", "bf16", "fp16"]
    runs: dict[str, list[dict[str, Any]]] = {p: [] for p in precisions}
    for rep in range(args.reps):
        for p in precisions[rep % 3 :] + precisions[: rep % 3]:
            runs[p].append(run_precision(p, args.smoke, args.steps, args.warmup, device))
            print(p, runs[p][-1], flush=True)
        release(device)
    base = {k: statistics.median(r[k] for r in runs["fp32"]) for k in ("s_per_step", "peak_mb")}
    rows = []
    for p, rs in runs.items():
        step = statistics.median(r["s_per_step"] for r in rs)
        peak = statistics.median(r["peak_mb"] for r in rs)
        rows.append(
            [
                p,
                f"{1000 * step:.1f}",
                f"{base['s_per_step'] / step:.2f}×",
                f"{peak:.0f}",
                f"{peak / base['peak_mb']:.2f}" if base["peak_mb"] == base["peak_mb"] else "n/a",
                f"{statistics.median(r['final_loss'] for r in rs):.3f}",
                str(all(r["fp32_weights"] for r in rs)),
            ]
        )
    print_table(["precision", "ms/step", "speed-up", "peak MB", "vs fp32", "loss", "fp32 weights"], rows)
    return {"runs": runs, "passed": True}


# --------------------------------------------------------------------------------- 2. throughput
def spec(seq: int) -> DatasetSpec:
    return DatasetSpec("lm", (seq,), VOCAB)


def build_gpt(size: Size, seq: int, device: torch.device | str) -> nn.Module:
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it trains: no host copy of a multi-GB model
        return build_model(ModelConfig(name="gpt", dropout=0.0, **asdict(size)), spec(seq))


def matmul_params(size: Size, seq: int) -> int:
    """N of the flops formula: every parameter but the position embedding (the tied embedding once)."""
    model = build_gpt(size, seq, "meta")  # shapes only, no memory
    return sum(p.numel() for name, p in model.named_parameters() if not name.startswith("pos_emb"))


def flops_per_token(size: Size, seq: int) -> int:
    return 6 * matmul_params(size, seq) + 12 * size.n_layer * size.n_embd * seq


def estimate_bytes(size: Size, batch: int, seq: int) -> float:
    params = sum(p.numel() for p in build_gpt(size, seq, "meta").parameters())
    tokens = batch * seq
    activations = ACTIVATION_BYTES * size.n_layer * size.n_embd * tokens + LOGIT_BYTES * tokens * VOCAB
    return MARGIN * (BYTES_PER_PARAM * params + activations)


def choose_size(ladder: tuple[Size, ...], batch: int, seq: int, free: float) -> int:
    """Index of the largest size whose estimate fits ``free`` bytes; prints the estimates."""
    rows, chosen = [], -1
    for i, size in enumerate(ladder):
        need = estimate_bytes(size, batch, seq)
        if need <= free:
            chosen = i
        rows.append(
            [str(size), f"{matmul_params(size, seq) / 1e6:,.4g}", f"{need / 2**30:.3g}", need <= free]
        )
    print(
        f"free memory {free / 2**30:.3g} GiB; estimate = {MARGIN} × ({BYTES_PER_PARAM} B/param + activations)"
    )
    print_table(["size", "N (M)", "estimate GiB", "fits"], rows)
    if chosen < 0:
        raise RuntimeError(f"no size fits {free / 2**30:.3g} GiB; lower --batch or --seq")
    return chosen


def time_plain(
    size: Size, args: argparse.Namespace, device: torch.device, pretend_oom: bool
) -> tuple[list[float], float]:
    """Plain PyTorch on one fixed batch: step times and the last loss."""
    model = build_gpt(size, args.seq, device)
    forward = torch.compile(model) if args.compile else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.0, fused=device.type == "cuda")
    tokens = torch.randint(0, VOCAB, (args.batch, args.seq + 1), device=device)
    # (B, T) each, contiguous as the Trainer's batches are: the same graph, so inductor's cache serves
    # the Trainer's compile
    inputs, target = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    losses = []

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = forward(inputs)  # (B, T, V)
            loss = F.cross_entropy(logits.flatten(0, 1), target.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        if pretend_oom:  # --smoke: the step-down path runs too
            raise torch.OutOfMemoryError("pretended by --smoke")

    return timed(step, args.throughput_steps, args.throughput_warmup, device), float(losses[-1])


def time_trainer(size: Size, args: argparse.Namespace, device: torch.device) -> tuple[list[float], float]:
    """vatra's Trainer, train.compile and bf16, on the text source: step times and the last loss."""
    raw = gpt_config("bf16", args.smoke, args.throughput_steps + args.throughput_warmup)
    raw["data"].update(block_size=args.seq, max_chars=max(200_000, 100 * args.seq))
    raw["train"].update(batch_size=args.batch, compile=args.compile)
    raw["model"].update(asdict(size))
    cfg = config_from_dict(raw)
    model = build_gpt(size, args.seq, device)
    trainer = Trainer.from_config(cfg, model=model, dist=DistContext(device=device))
    losses: list[float] = []
    try:
        times = timed(
            lambda: losses.append(trainer.train_step()["loss"]),
            args.throughput_steps,
            args.throughput_warmup,
            device,
        )
    finally:
        trainer.batches.close()
    return times, losses[-1]


def side(
    name: str, run: Callable[[], tuple[list[float], float]], args: argparse.Namespace, device: torch.device
) -> dict[str, Any]:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, loss = run()
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else float("nan")
    step = statistics.median(times[args.throughput_warmup :])
    release(device)
    return {
        "side": name,
        "s_per_step": step,
        "tokens_per_s": args.batch * args.seq / step,
        "first_step_s": times[0],  # compiling, with --compile
        "peak_gib": peak / 2**30,
        "final_loss": loss,
    }


def both_sides(
    size: Size, args: argparse.Namespace, device: torch.device, pretend_oom: bool
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Plain PyTorch, then the Trainer, at ``size`` (one after the other: both would not fit at once)."""
    plain = side("plain", lambda: time_plain(size, args, device, pretend_oom), args, device)
    return plain, side("vatra", lambda: time_trainer(size, args, device), args, device)


def check_throughput(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    ladder = SMOKE_LADDER if args.smoke else LADDER
    release(device)
    if args.free_gb is not None:
        free = args.free_gb * 2**30
    else:
        free = SMOKE_FREE_BYTES if args.smoke else torch.cuda.mem_get_info()[0]
    index = choose_size(ladder, args.batch, args.seq, free)
    out_of_memory: list[dict[str, Any]] = []
    for size in reversed(ladder[: index + 1]):
        print(f"size {size}: N = {matmul_params(size, args.seq) / 1e6:,.4g} M", flush=True)
        try:
            plain, vatra = both_sides(size, args, device, pretend_oom=args.smoke and not out_of_memory)
            break
        except torch.OutOfMemoryError as err:
            out_of_memory.append({"size": asdict(size), "error": str(err).splitlines()[0]})
            print(f"size {size}: out of memory ({out_of_memory[-1]['error']}); one size down", flush=True)
        release(device)
    else:
        raise RuntimeError("every size of the ladder ran out of memory")
    flops = flops_per_token(size, args.seq)
    ratio = vatra["tokens_per_s"] / plain["tokens_per_s"]
    rows = []
    for r in (plain, vatra):
        r["mfu"] = r["tokens_per_s"] * flops / args.peak
        r["optimizer"] = "AdamW fused" if device.type == "cuda" else "AdamW (default)"  # both sides
        rows.append(
            [
                r["side"],
                r["optimizer"],
                f"{1000 * r['s_per_step']:.1f}",
                f"{r['tokens_per_s']:,.0f}",
                f"{100 * r['mfu']:.1f} %",
                f"{r['first_step_s']:.1f}",
                f"{r['peak_gib']:.1f}",
                f"{r['final_loss']:.3f}",
            ]
        )
    headers = ["side", "optimizer", "ms/step", "tokens/s", "MFU", "first step s", "peak GiB", "loss"]
    print_table(headers, rows)
    print(
        f"vatra / plain tokens/s = {ratio:.3f} (target ≥ 0.98: {'met' if ratio >= 0.98 else 'not met'}); "
        f"{flops / 1e9:.3g} GFLOP/token, peak {args.peak / 1e12:.0f} TFLOP/s"
        + (" (pretend)" if args.smoke and args.peak_tflops is None else "")
        + ("; smoke: CPU figures, no measurement" if args.smoke else ""),
        flush=True,
    )
    finite = all(math.isfinite(r["final_loss"]) for r in (plain, vatra))
    return {
        "size": asdict(size),
        "matmul_params": matmul_params(size, args.seq),
        "estimate_gib": estimate_bytes(size, args.batch, args.seq) / 2**30,
        "free_gib": free / 2**30,
        "batch": args.batch,
        "seq": args.seq,
        "compile": args.compile,
        "flops_per_token": flops,
        "peak_flops": args.peak,
        "out_of_memory": out_of_memory,
        "plain": plain,
        "vatra": vatra,
        "ratio": ratio,
        "passed": finite,
    }


# ------------------------------------------------------------------------------------- 3. fsdp
def check_fsdp(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    backend = "nccl" if device.type == "cuda" else "gloo"
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    ctx = DistContext.init(
        DistConfig(backend=backend, timeout_s=120), rank=0, world_size=1, init_method="env://"
    )
    try:
        size, seq, steps = Size(2, 4, 64 if args.smoke else 256), 64, 8
        model = build_gpt(size, seq, ctx.device)
        reference = copy.deepcopy(model)
        apply_fsdp(model, Mesh.build(ParallelConfig(), ctx.device).data, ParallelConfig())
        sharded = all(isinstance(p, DTensor) for p in model.parameters())
        tokens = torch.randint(0, VOCAB, (8, seq + 1), device=ctx.device)
        inputs, target = tokens[:, :-1], tokens[:, 1:]  # (B, T) each

        def loss_of(m: nn.Module) -> torch.Tensor:
            return F.cross_entropy(m(inputs).flatten(0, 1), target.flatten())

        with torch.no_grad():
            unsharded = float(loss_of(reference))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
        losses = []
        for _ in range(steps):
            loss = loss_of(model)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
        total = torch.tensor([losses[-1]], device=ctx.device)
        dist.all_reduce(total)  # one plain collective besides FSDP's own
        checks = {
            "parameters are DTensors": sharded,
            "losses finite": all(math.isfinite(v) for v in losses),
            "loss falls": losses[-1] < losses[0],
            "first loss = unsharded's (rtol 1e-5)": math.isclose(losses[0], unsharded, rel_tol=1e-5),
            "all_reduce of 1 rank": float(total) == losses[-1],
        }
    finally:
        ctx.destroy()
    print_table(["fsdp on 1 rank, " + backend, "pass"], [[k, v] for k, v in checks.items()])
    print(f"losses {losses[0]:.4f} → {losses[-1]:.4f}; unsharded first loss {unsharded:.4f}", flush=True)
    return {
        "backend": backend,
        "losses": losses,
        "unsharded_first_loss": unsharded,
        **checks,
        "passed": all(checks.values()),
    }


PARTS = {"precision": check_precision, "throughput": check_throughput, "fsdp": check_fsdp}
PARTS["energy"] = gpu_energy.check_energy  # the search lives in its own file


def peak_flops(ap: argparse.ArgumentParser, args: argparse.Namespace) -> float:
    if args.peak_tflops is not None:
        return float(args.peak_tflops) * 1e12
    if args.smoke:
        return SMOKE_PEAK
    name = torch.cuda.get_device_name()
    found = next((peak for key, peak in PEAK_BF16 if key in name), None)
    if found is None:
        ap.exit(2, f"error: no dense bf16 peak known for {name!r}; pass --peak-tflops (the datasheet's)\n")
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny models on the CPU: checks the script only")
    ap.add_argument("--parts", nargs="+", choices=list(PARTS), default=list(PARTS))
    ap.add_argument("--steps", type=int, default=60, help="precision: steps per run")
    ap.add_argument("--warmup", type=int, default=10, help="precision: steps not timed")
    ap.add_argument("--reps", type=int, default=2, help="precision: runs per precision")
    ap.add_argument("--throughput-steps", type=int, default=20, help="throughput: timed steps per side")
    ap.add_argument("--throughput-warmup", type=int, default=5, help="throughput: steps before (compiling)")
    ap.add_argument("--batch", type=int, default=None, help="throughput: sequences a step (8; smoke 4)")
    ap.add_argument("--seq", type=int, default=None, help="throughput: tokens a sequence (2048; smoke 64)")
    ap.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="throughput: torch.compile on both sides (default: on, off with --smoke)",
    )
    ap.add_argument(
        "--free-gb", type=float, default=None, help="throughput: memory to fit (GiB; default free)"
    )
    ap.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak for the MFU")
    gpu_energy.add_arguments(ap)
    args = ap.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        ap.exit(2, "error: no CUDA device here; run with --smoke to check the script on the CPU\n")
    args.batch = args.batch or (4 if args.smoke else 8)
    args.seq = args.seq or (64 if args.smoke else 2048)
    args.compile = not args.smoke if args.compile is None else args.compile
    args.peak = peak_flops(ap, args)
    device = torch.device("cpu" if args.smoke else "cuda")
    results: dict[str, Any] = {"device": "cpu (smoke)" if args.smoke else torch.cuda.get_device_name()}
    for part in args.parts:
        print(f"== {part}", flush=True)
        t0 = time.perf_counter()
        try:
            results[part] = PARTS[part](args, device)
        except Exception as err:  # the other parts still run: a device is lent rarely
            traceback.print_exc()
            results[part] = {"error": f"{type(err).__name__}: {err}", "passed": False}
        results[part]["wall_s"] = time.perf_counter() - t0
        release(device)
    write_result("gpu_check_smoke" if args.smoke else "gpu_check", results)
    failed = [part for part in args.parts if not results[part]["passed"]]
    print_table(
        ["part", "wall s", "passed"],
        [[p, f"{results[p]['wall_s']:.0f}", p not in failed] for p in args.parts],
    )
    if failed:
        raise SystemExit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
