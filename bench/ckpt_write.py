"""Checkpoint cost: store write throughput vs raw disk writes, async vs sync blocking, zfec speed.

One process, one model (MLP, AdamW: weights + two moment buffers), all in one run:

1. raw:   write the same number of bytes with os.write + fsync into the same folder (the disk's
          sequential write speed, the ceiling) — vs a full synchronous checkpoint (DCP write +
          sha256 + store objects + manifest). Ratio = checkpoint MB/s ÷ raw MB/s (target ≥ 0.6).
2. block: seconds the training loop is blocked per checkpoint, sync vs async (host copy only).
3. zfec:  erasure encode (k=4, m=6) and decode with two primary shards lost, MB/s, next to sha256
          hashing of the same buffer as a reference point.

    .venv/bin/python bench/ckpt_write.py [--hidden 2048] [--layers 4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from _common import print_table, write_result
from vatra.config import config_from_dict
from vatra.engine import Trainer
from vatra.resilience import CheckpointPlugin, open_store
from vatra.resilience.erasure import decode, encode, parse_shard
from vatra.rundir import RunDir


def raw_write(folder: Path, nbytes: int) -> float:
    """Seconds to write ``nbytes`` sequentially in 8 MiB chunks and fsync (what dd conv=fsync does)."""
    chunk = os.urandom(8 << 20)
    path = folder / "raw.bin"
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    left = nbytes
    while left > 0:
        left -= os.write(fd, chunk[: min(left, len(chunk))])
    os.fsync(fd)
    os.close(fd)
    elapsed = time.perf_counter() - t0
    path.unlink()
    return elapsed


def trainer_for(run: Path, hidden: int, layers: int, is_async: bool) -> tuple[Trainer, CheckpointPlugin]:
    cfg = config_from_dict(
        {
            "run": {"progress": "off", "tensorboard": False},
            "data": {"name": "synthetic", "samples": 2000},
            "model": {"name": "mlp", "hidden": [hidden] * layers},
            "train": {"steps": 1000, "batch_size": 32},
            "checkpoint": {"every_steps": 0, "async": is_async, "keep_last": 2},
        }
    )
    rd = RunDir(run).create()
    plugin = CheckpointPlugin(cfg, rd)
    trainer = Trainer.from_config(cfg, plugins=[plugin], run_dir=rd)
    trainer.plugins.on_fit_start(trainer)
    trainer.train_step()  # optimizer moments exist: the checkpoint has its full size
    return trainer, plugin


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(dir=Path(__file__).resolve().parent) as tmp:
        base = Path(tmp)
        sync_t, sync_p = trainer_for(base / "sync", args.hidden, args.layers, False)
        async_t, async_p = trainer_for(base / "async", args.hidden, args.layers, True)
        store = open_store(sync_t.cfg.store, base / "sync" / "checkpoints")
        raw_s, ckpt_s, block_sync, block_async, async_total = [], [], [], [], []
        nbytes = 0
        for _ in range(args.repeats):
            # 1 + 2 (sync): the whole save blocks the loop
            sync_t.train_step()
            t0 = time.perf_counter()
            version = sync_p.save(sync_t)
            ckpt_s.append(time.perf_counter() - t0)
            block_sync.append(sync_p.costs[-1])
            nbytes = sum(e["size"] for e in store.manifest(version)["files"].values())
            raw_s.append(raw_write(base, nbytes))
            # 2 (async): the loop waits for the host copy only; the rest overlaps training
            async_t.train_step()
            t0 = time.perf_counter()
            async_p.save(async_t)
            block_async.append(async_p.costs[-1])
            async_p.wait()
            async_total.append(time.perf_counter() - t0)
        mb = nbytes / 1e6
        ckpt_mbs, raw_mbs = mb / statistics.median(ckpt_s), mb / statistics.median(raw_s)
        # 3: erasure coding of one checkpoint-sized buffer
        data = os.urandom(nbytes)
        t0 = time.perf_counter()
        shards = encode(data, 4, 6)
        enc_s = time.perf_counter() - t0
        payloads = {i: parse_shard(shards[i]).payload for i in (2, 3, 4, 5)}
        t0 = time.perf_counter()
        assert decode(payloads, 4, 6, nbytes) == data
        dec_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        hashlib.sha256(data).digest()
        sha_s = time.perf_counter() - t0
    b_sync, b_async = statistics.median(block_sync), statistics.median(block_async)
    rows = [
        ["raw write + fsync", mb, raw_mbs, "1.00"],
        ["checkpoint (sync, store)", mb, ckpt_mbs, f"{ckpt_mbs / raw_mbs:.2f}"],
        ["zfec encode k=4 m=6", mb, mb / enc_s, f"{enc_s / sha_s:.2f}x sha256 time"],
        ["zfec decode (2 primaries lost)", mb, mb / dec_s, f"{dec_s / sha_s:.2f}x sha256 time"],
        ["sha256 (reference)", mb, mb / sha_s, "-"],
    ]
    print_table(["what", "MB", "MB/s", "ratio"], rows)
    print_table(
        ["mode", "blocked s (median)", "save total s (median)", "blocked ÷ sync"],
        [
            ["sync", b_sync, statistics.median(ckpt_s), "1.00"],
            ["async", b_async, statistics.median(async_total), f"{b_async / b_sync:.3f}"],
        ],
    )
    write_result(
        "ckpt_write",
        {
            "command": "bench/ckpt_write.py " + " ".join(sys.argv[1:]),
            "checkpoint_mb": mb,
            "raw_write_mb_s": raw_mbs,
            "checkpoint_mb_s": ckpt_mbs,
            "throughput_ratio": ckpt_mbs / raw_mbs,
            "blocked_sync_s": b_sync,
            "blocked_async_s": b_async,
            "async_blocked_ratio": b_async / b_sync,
            "zfec_encode_mb_s": mb / enc_s,
            "zfec_decode_mb_s": mb / dec_s,
            "sha256_mb_s": mb / sha_s,
            "samples": {
                "raw_s": raw_s,
                "ckpt_s": ckpt_s,
                "block_sync_s": block_sync,
                "block_async_s": block_async,
            },
        },
    )


if __name__ == "__main__":
    main()
