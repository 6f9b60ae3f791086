"""Which ``dist.mode`` composes with which other settings (a validator of :class:`~vatra.config.Config`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vatra.config._load import Config


def check_dist_mode(cfg: Config) -> None:
    """ValueError naming the setting a non-sync ``dist.mode`` cannot run with, and the fix; sets
    ``dist.ps_wire`` from a legacy ``comm.method = fp16/bf16`` under ``dist.mode = 'async'``."""
    mode = cfg.dist.mode
    if mode == "sync":
        return
    if cfg.balance.method != "off":
        raise ValueError(
            f"dist.mode = {mode!r}: every rank takes the same number of local steps on batches of "
            "train.batch_size, so uneven per-rank batches do not apply; set balance.method = 'off' "
            "(diloco.adaptive_steps gives a slow rank fewer local steps instead)"
        )
    hooked = cfg.comm.topology in ("ring", "hierarchical")
    if mode == "local_sgd" and (cfg.comm.method != "none" or hooked):
        raise ValueError(
            "dist.mode = 'local_sgd' averages parameters with torch's model averager (and DDP's own "
            "all-reduce during local_sgd.warmup_steps), without comm's hooks; set comm.method = 'none' "
            "and comm.topology = 'auto', or use dist.mode = 'diloco', whose pseudo-gradients go "
            "through comm"
        )
    legacy = cfg.comm.method in ("fp16", "bf16")  # before dist.ps_wire, comm.method set the push dtype
    if mode == "async" and (hooked or not (cfg.comm.method == "none" or legacy) or (
        legacy and "ps_wire" in cfg.dist.model_fields_set and cfg.dist.ps_wire != cfg.comm.method
    )):  # fmt: skip
        raise ValueError(
            f"dist.mode = 'async' sends pushes and pulls as dist.ps_wire says ({cfg.dist.ps_wire!r}), "
            f"not through comm.method {cfg.comm.method!r} over comm.topology {cfg.comm.topology!r}; "
            "set comm.method = 'none', comm.topology = 'auto' and dist.ps_wire (fp32, fp16, bf16, "
            "topk...)"
        )
    if mode == "async" and legacy:
        cfg.dist.ps_wire = cfg.comm.method
    if mode in ("diloco", "hybrid") and cfg.comm.method == "powersgd":
        raise ValueError(
            f"dist.mode = {mode!r} with comm.method = 'powersgd': the pseudo-gradient is averaged once "
            "per round, where PowerSGD's warm-started factors do not carry over; use fp16, bf16, topk, "
            "randomk, onebit or qsgd"
        )
    return
