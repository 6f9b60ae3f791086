"""The baselines of bench/comm_vs_torch.py: torch's own DDP communication hooks on vatra's loop.

    vatra run bench/_torch_hooks.py -- HOOK CONFIG [--set key=value ...]

HOOK is ``fp16`` (torch's ``fp16_compress_hook``), ``powersgd`` (torch's ``powerSGD_hook`` as torch
ships it: rank 4, warm start, error feedback; compression from step 2 as vatra's own starts it) or
``floor`` (no communication at all: each rank keeps its own gradient, so the step time is the compute
floor; the replicas drift apart and the accuracy means nothing). The config's ``comm.method`` must be
``none``: vatra then registers no hook of its own and counts the bytes DDP's all-reduce would send,
so these runs are measured by the links' own counters.

torch's PowerSGD hook needs a single DDP bucket on gloo (see ../shared/NOTES.md): pass
``--set dist.bucket_cap_mb=64`` (larger than the model) with it.
"""

# No `from __future__ import annotations`: DDP checks a hook's annotations as real objects.

import argparse

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
from torch.nn.parallel import DistributedDataParallel as DDP

import vatra
from vatra.config import load_config
from vatra.engine import Plugin, Trainer


def _no_communication(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


class TorchHook(Plugin):
    def __init__(self, hook: str, seed: int) -> None:
        self.hook, self.seed = hook, seed

    def on_fit_start(self, trainer: Trainer) -> None:
        if not isinstance(trainer.module, DDP):
            return
        if self.hook == "fp16":
            trainer.module.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif self.hook == "powersgd":
            state = psgd.PowerSGDState(
                process_group=None,
                matrix_approximation_rank=4,
                start_powerSGD_iter=2,
                use_error_feedback=True,
                warm_start=True,
                random_seed=self.seed,
            )
            trainer.module.register_comm_hook(state, psgd.powerSGD_hook)
        else:
            trainer.module.register_comm_hook(None, _no_communication)
        trainer.log_event("comm", method=f"torch-{self.hook}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("hook", choices=["fp16", "powersgd", "floor"])
    ap.add_argument("config")
    ap.add_argument("--set", dest="sets", action="append", default=[])
    args = ap.parse_args()
    cfg = load_config(args.config, args.sets)
    if cfg.comm.method != "none":
        raise SystemExit("error: the torch hooks run with comm.method = 'none'")
    vatra.fit(cfg, plugins=[TorchHook(args.hook, cfg.run.seed)])


if __name__ == "__main__":
    main()
