"""The server's unmasking time per secure-aggregation round with one lying share holder, before and after.

    python bench/secagg_liar.py [--clients 20 50 100] [--dim 10000] [--drop 0.1] [--full-before 50]
                                [--sample 4]

One round in one process (full mode, default t = ⌈2n/3⌉): ``--drop`` of the clients vanish after
key sharing, so the server rebuilds self-mask seeds of the survivors and mask keys of the
drop-outs; holder 0, whose share every fast-path rebuild uses, reveals a wrong share of every
secret it holds. Timed: ``SecAggServer.finish`` (rebuild every secret, remove the masks), the
fastest of two tries (CPU time, and wall time, which on a shared machine also counts waiting for
a core), with the number of Berlekamp–Welch decodes.

- after: the server's path — once a decode names the liar, the secrets still failing go back to
  the fast path without it;
- before: the path it replaced — the fast path once, then every secret that failed it decoded by
  Berlekamp–Welch (``PerSecretDecode`` below: the same server without the retry). Timed in full up
  to ``--full-before`` clients; above, one decode costs the same for every secret of a round (its
  size is the number of holders), so the time is the measured after path plus (decodes − 1) ×
  the mean of ``--sample`` timed decodes, marked "est." in the table.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import time
from typing import Any

import numpy as np

from _common import print_table, write_result
from vatra.config import SecureAggregationConfig
from vatra.federated.secagg import LocalParties, Quantizer, SecAggServer
from vatra.federated.secagg import server as secagg_server
from vatra.federated.secagg.crypto import PRIME, bytes_int, int_bytes

DECODES: list[int] = []  # one entry per Berlekamp–Welch decode: its number of shares
_decode_shares = secagg_server.decode_shares


def _counted(shares: dict[int, int], t: int) -> tuple[bytes, list[int]]:
    DECODES.append(len(shares))
    return _decode_shares(shares, t)


secagg_server.decode_shares = _counted  # type: ignore[assignment]


class PerSecretDecode(SecAggServer):
    """The unmasking before the fix: after a blame, every secret still failing is decoded alone."""

    def _fast_path(self, owners: list[int], *args: Any) -> list[int]:
        wrong = args[3]
        return list(owners) if wrong else super()._fast_path(owners, *args)


def _lie(replies: dict[int, dict]) -> dict[int, dict]:
    """Holder 0 adds 1 to every share it reveals (seeds of survivors, mask keys of drop-outs)."""
    r = dict(replies[0])
    for kind in ("b_shares", "s_shares"):
        r[kind] = {v: int_bytes((bytes_int(s) + 1) % PRIME) for v, s in dict(r[kind]).items()}
    return {**replies, 0: r}


def round_to_unmask(n: int, dim: int, drop: float) -> tuple[SecAggServer, dict[int, dict], list[np.ndarray]]:
    """Run three stages honestly; the server ready to finish, the unmask replies (with the lie)."""
    cfg = SecureAggregationConfig(enabled=True)
    rng = np.random.default_rng(n)
    xs = [rng.uniform(-1, 1, dim) for _ in range(n)]
    parties = LocalParties(cfg, lambda cid, n1: Quantizer(cfg.bits, cfg.clip, n1).encode(xs[cid]))
    parties.trained(1, range(n))
    parties.drops[(1, "masked_input")] = set(range(n - round(drop * n), n))
    server = SecAggServer(1, cfg, list(range(n)), dim, seed=n)
    replies = parties.exchange("advertise", 1, server.advertise_requests())
    replies = parties.exchange("share_keys", 1, server.share_keys_requests(replies))
    replies = parties.exchange("masked_input", 1, server.masked_input_requests(replies))
    replies = parties.exchange("unmask", 1, server.unmask_requests(replies))
    return server, _lie(replies), [xs[c] for c in sorted(server.masked)]


def timed_finish(
    server: SecAggServer, replies: dict[int, dict], survivors: list[np.ndarray]
) -> dict[str, Any]:
    """Fastest of two tries of ``finish`` on copies of ``server``; checks the sum and the blame."""
    best: dict[str, Any] = {}
    for _ in range(2):
        s = copy.deepcopy(server)
        DECODES.clear()
        t0, c0 = time.perf_counter(), time.process_time()
        total = s.finish(copy.deepcopy(replies))
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        q = Quantizer(s.cfg.bits, s.cfg.clip, len(s.keys))
        err = float(np.abs(q.decode_sum(total) - np.sum(survivors, axis=0)).max())
        assert err <= q.max_error(len(s.keys)), err
        assert sorted(s.rejected) == [0], s.rejected
        if not best or wall < best["s"]:
            best = {"s": wall, "cpu_s": cpu, "decodes": len(DECODES), "shares": max(DECODES)}
    return best


class _Enough(Exception):
    pass


def sampled_decode_s(server: SecAggServer, replies: dict[int, dict], sample: int) -> tuple[float, float]:
    """Mean (wall, CPU) seconds of one decode on the before path: its first ``sample`` decodes."""
    s = PerSecretDecode(**vars(copy.deepcopy(server)))
    times: list[tuple[float, float]] = []
    decode = s._decode

    def one(*a: Any) -> bytes:
        if len(times) == sample:
            raise _Enough
        t0, c0 = time.perf_counter(), time.process_time()
        out = decode(*a)
        times.append((time.perf_counter() - t0, time.process_time() - c0))
        return out

    s._decode = one  # type: ignore[method-assign]
    with contextlib.suppress(_Enough):
        s.finish(copy.deepcopy(replies))
    wall, cpu = np.mean(times, axis=0).tolist()
    return wall, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, nargs="+", default=[20, 50, 100])
    ap.add_argument("--dim", type=int, default=10_000, help="words per masked vector")
    ap.add_argument("--drop", type=float, default=0.1, help="share of clients vanishing after key sharing")
    ap.add_argument("--full-before", type=int, default=50, help="time the before path in full up to this n")
    ap.add_argument("--sample", type=int, default=4, help="decodes timed for an estimated before path")
    args = ap.parse_args()
    rows: list[dict[str, Any]] = []
    for n in args.clients:
        server, replies, survivors = round_to_unmask(n, args.dim, args.drop)
        after = timed_finish(server, replies, survivors)
        if n <= args.full_before:
            before = timed_finish(PerSecretDecode(**vars(server)), replies, survivors)
            assert before["decodes"] == len(server.u2), before
            before["estimated"] = False
        else:
            # the liar's share is in every secret's fast-path set: the before path decodes them all
            # (asserted where it is timed in full)
            wall, cpu = sampled_decode_s(server, replies, args.sample)
            more = len(server.u2) - after["decodes"]
            before = {
                "s": after["s"] + more * wall,
                "cpu_s": after["cpu_s"] + more * cpu,
                "decodes": len(server.u2),
                "shares": after["shares"],
                "estimated": True,
                "per_decode_s": wall,
                "per_decode_cpu_s": cpu,
            }
        rows.append(
            {"clients": n, "t": server.t, "secrets": len(server.u2), "before": before, "after": after}
        )
        print(f"n={n}: before {before['cpu_s']:.2f} s CPU, after {after['cpu_s']:.3f} s CPU", flush=True)
    print(f"\none liar (holder 0) at unmask; {args.drop:.0%} drop after key sharing; {args.dim} words/vector")
    print("server's finish(): CPU seconds (wall seconds on a shared machine in brackets)")

    def cell(r: dict[str, Any]) -> str:
        return f"{r['cpu_s']:.3f} ({r['s']:.3f})" + (" est." if r.get("estimated") else "")

    print_table(
        ["clients", "t", "secrets", "decodes before", "decodes after", "before s", "after s", "speed-up"],
        [
            [
                r["clients"],
                r["t"],
                r["secrets"],
                r["before"]["decodes"],
                r["after"]["decodes"],
                cell(r["before"]),
                cell(r["after"]),
                f"{r['before']['cpu_s'] / r['after']['cpu_s']:.0f}x",
            ]
            for r in rows
        ],
    )
    write_result("secagg_liar", {"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
