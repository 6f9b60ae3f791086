"""Each method's defaults are the recipe that keeps accuracy: ``"auto"`` settings resolved against
the run's optimizer and schedule.

A user who sets only ``comm.method`` gets, where it applies (every part stays overridable):

* an uncompressed warm-up (``start_step``): at least the learning-rate warm-up
  (``optim.warmup_steps``), and for the methods that lose accuracy under Adam without more a share of
  ``train.steps`` (the class's ``dense_share``: a quarter for topk and onebit, 40 % for randomk):
  with the LR warm-up alone, topk ended 3.6 points behind on synthetic, onebit 1.8, randomk 12.9;
* for sparsifiers the class's ``auto_ratio``: topk keeps 25 % (at 10 % it ended 1.4 points behind on
  gpt_text even after the dense quarter), randomk 50 %; at these shares a bitmask says where the
  values are (n/8 bytes) instead of int32 indices, and randomk sends only values, all-reduced at
  indices every rank draws alike;
* DGC's sparsity warm-up (25 % sent, falling geometrically to ``comm.ratio`` over as many steps as
  the dense warm-up) where ``comm.ratio`` is set below 25 %;
* DGC momentum correction for onebit when the optimizer is SGD with momentum (not for the
  sparsifiers: with it topk ended 1.9–4.2 points behind on digits, without it 0.3 ahead);
* per-row scales for onebit (the ``onebit_scale`` default), and for qsgd 127 levels with one norm
  per 512 elements (the ``levels`` and ``qsgd_bucket`` defaults).

The measurements behind each choice are in docs/communication.md ("Defaults that keep accuracy").
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from vatra.comm._base import AUTO_RATIO, Compressor, SparseCompressor
from vatra.config._comm import CommConfig

if TYPE_CHECKING:
    from vatra.config import Config


def resolve_recipe(comm: CommConfig, cfg: Config, compressor: Compressor | None) -> CommConfig:
    """``comm`` with every ``"auto"`` replaced by the value this run gets (the plugin logs them).
    ``compressor`` is the method's (None for powersgd, a DDP hook with no Compressor)."""
    lossless = compressor is not None and compressor.lossless
    cast = getattr(compressor, "wire_dtype", None) is not None  # fp16/bf16: rounding, nothing dropped
    sparse = isinstance(compressor, SparseCompressor)
    optim = cfg.optim
    mc = comm.momentum_correction
    if mc == "auto":
        feedback = compressor is not None and compressor.error_feedback and comm.error_feedback
        # not for sparsifiers: on digits under SGD, topk with momentum correction (and its masking)
        # ended 1.9 points behind at 1 % and 4.2 at 10 %, and 0.3 ahead without it at 10 %
        mc = optim.name == "sgd" and optim.momentum > 0.0 and feedback and not (lossless or cast or sparse)
    start = comm.start_step
    if start == "auto":
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
    if warm == "auto":  # DGC's warm-up starts at 25 % sent: nothing to warm up from at a larger share
        warm = start if sparse and ratio < 0.25 else 0
    update = {"start_step": start, "sparsity_warmup": warm, "momentum_correction": mc, "ratio": ratio}
    return comm.model_copy(update=update)
