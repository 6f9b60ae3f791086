"""Each method's defaults are the recipe that keeps accuracy: ``"auto"`` settings resolved against
the run's optimizer and schedule.

A user who sets only ``comm.method`` gets, where it applies (every part stays overridable):

* an uncompressed warm-up (``start_step``): for topk, onebit and randomk (the classes with a
  ``dense_share``) it ends when the loss curve has settled (``vatra.comm.warmup``: never before the
  LR warm-up, ``optim.warmup_steps``; at the latest at ``dense_share`` of ``train.steps``, the
  fixed warm-up these methods had before: the value resolved here is that limit); for the other
  lossy methods the LR warm-up;
* for sparsifiers the class's ``auto_ratio``: topk keeps 1 %, randomk 3 % (randomk sends only
  values, all-reduced at indices every rank draws alike);
* DGC's sparsity warm-up after it (25 % sent, falling geometrically to ``comm.ratio`` over as many
  steps as the dense warm-up took) where ``comm.ratio`` is below 25 %;
* DGC momentum correction for onebit and randomk when the optimizer is SGD with momentum (not for
  topk: with it topk ended 1.9–4.2 points behind on digits, without it 0.3 ahead), and
  DGC's local gradient clipping wherever error feedback runs and ``train.clip_grad_norm`` is set;
* per-row scales for onebit (the ``onebit_scale`` default), and for qsgd 127 levels with one norm
  per 512 elements (the ``levels`` and ``qsgd_bucket`` defaults);
* the buckets' work on a background thread (``overlap``), except vatra's powersgd on CPU: there
  its projections competed with backward for the cores (4-host cluster, 100 Mbit/s: 0.155–0.185 s
  a step without the thread, 0.179–0.192 with it, three runs each).

The measurements behind each choice are in docs/communication.md ("Defaults that keep accuracy").
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from vatra.comm._base import AUTO_RATIO, Compressor, SparseCompressor
from vatra.config._comm import CommConfig

if TYPE_CHECKING:
    from vatra.config import Config


def resolve_recipe(
    comm: CommConfig, cfg: Config, compressor: Compressor | None, device: str = "cpu"
) -> CommConfig:
    """``comm`` with every ``"auto"`` replaced by the value this run gets (the plugin logs them).
    ``compressor`` is the method's (None for powersgd, a DDP hook with no Compressor); ``device``
    the type of the device training runs on."""
    lossless = compressor is not None and compressor.lossless
    cast = getattr(compressor, "wire_dtype", None) is not None  # fp16/bf16: rounding, nothing dropped
    sparse = isinstance(compressor, SparseCompressor)
    optim = cfg.optim
    mc = comm.momentum_correction
    if mc == "auto":
        feedback = compressor is not None and compressor.error_feedback and comm.error_feedback
        # not for topk: on digits under SGD (300 steps) with momentum correction (and its masking) it
        # ended 1.9 points behind at 1 % and 4.2 at 10 %, 0.3 ahead without it at 10 %; randomk at 3 %
        # (2,000 steps) ended 0.6 behind with it, 1.7 without
        topk = sparse and not getattr(compressor, "stochastic", False)
        mc = optim.name == "sgd" and optim.momentum > 0.0 and feedback and not (lossless or cast or topk)
    start = comm.start_step
    if start == "auto":  # with a dense_share: the signal-driven warm-up's limit (vatra.comm.warmup)
        share = compressor.dense_share if compressor is not None else 0.0
        start = 0 if lossless or cast else max(optim.warmup_steps, math.ceil(share * cfg.train.steps))
    if comm.method == "powersgd" and comm.powersgd_impl == "torch":
        start = max(2, start)  # torch's hook keys its state by bucket, and DDP rebuilds them after step 1
    ratio = comm.ratio
    if isinstance(compressor, SparseCompressor):  # isinstance again: narrows the type for mypy
        ratio = compressor.auto_ratio if ratio == "auto" else ratio
        compressor.ratio = ratio
    elif ratio == "auto":
        ratio = AUTO_RATIO
    warm = comm.sparsity_warmup
    # DGC's warm-up starts at 25 % sent: nothing to warm up from at a larger share; after a
    # signal-driven warm-up vatra.comm.warmup sets it to the warm-up's measured length
    if warm == "auto":
        warm = start if sparse and ratio < 0.25 else 0
    overlap = comm.overlap
    if overlap == "auto":
        overlap = not (comm.method == "powersgd" and comm.powersgd_impl == "vatra" and device == "cpu")
    return comm.model_copy(
        update={
            "start_step": start,
            "sparsity_warmup": warm,
            "momentum_correction": mc,
            "ratio": ratio,
            "overlap": overlap,
        }
    )
