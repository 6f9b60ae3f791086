"""Each method's defaults are the recipe that keeps accuracy: ``"auto"`` settings resolved against
the run's optimizer and schedule.

A user who sets only ``comm.method`` gets, where it applies (every part stays overridable):

* an uncompressed warm-up as long as the learning-rate warm-up (``start_step = optim.warmup_steps``):
  the first, largest and least aligned gradients go dense while the optimizer's state settles;
* for sparsifiers, DGC's sparsity warm-up over as many steps again (25 % sent, falling geometrically
  to ``comm.ratio``), which is 10 %: at 1 % topk lost 1.9–3.6 points on digits with AdamW and with
  SGD plus momentum correction alike;
* DGC momentum correction for onebit when the optimizer is SGD with momentum (not for the
  sparsifiers: with it topk ended 1.9–4.2 points behind on digits, without it 0.3 ahead);
* per-row scales for onebit (the ``onebit_scale`` default), and for qsgd 127 levels with one norm
  per 512 elements (the ``levels`` and ``qsgd_bucket`` defaults).

The measurements behind each choice are in docs/communication.md ("Defaults that keep accuracy").
"""

from __future__ import annotations

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
        start = 0 if lossless or cast else optim.warmup_steps
    if comm.method == "powersgd" and comm.powersgd_impl == "torch":
        start = max(2, start)  # torch's hook keys its state by bucket, and DDP rebuilds them after step 1
    warm = comm.sparsity_warmup
    if warm == "auto":
        warm = start if sparse else 0
    ratio = AUTO_RATIO if comm.ratio == "auto" else comm.ratio
    if isinstance(compressor, SparseCompressor):  # isinstance again: narrows the type for mypy
        compressor.ratio = ratio
    update = {"start_step": start, "sparsity_warmup": warm, "momentum_correction": mc, "ratio": ratio}
    return comm.model_copy(update=update)
