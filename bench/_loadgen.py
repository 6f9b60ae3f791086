"""A closed-loop HTTP load generator: N clients on keep-alive connections, each POSTing one request
after the other for a while. It runs as its own process, and speaks HTTP/1.1 itself on asyncio
streams: httpx's AsyncClient, tried first, topped out near 280 requests/s at 8 clients and fell to
10–20 requests/s at 64 against an empty endpoint on this machine, where this loop does ~1,200.

    python bench/_loadgen.py URL --clients 64 --seconds 10 --rows-file rows.json

Prints one JSON object: requests, errors, seconds, requests per second, latency p50/p99 (ms).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit


def request(host: str, rows: list[dict[str, Any]], rng: random.Random) -> bytes:
    body = json.dumps({"rows": [rng.choice(rows)], "key": str(rng.getrandbits(32))}).encode()
    head = f"POST /predict HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
    return f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body


async def exchange(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, message: bytes) -> int:
    """Send one request, read its response; the status code."""
    writer.write(message)
    await writer.drain()
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
    length = next(int(h.split(":", 1)[1]) for h in head if h.lower().startswith("content-length:"))
    await reader.readexactly(length)
    return int(head[0].split()[1])


async def client(
    url: str, rows: list[dict[str, Any]], until: float, warm: float, out: dict[str, list[float]]
) -> None:
    where = urlsplit(url)
    rng = random.Random()
    reader, writer = await asyncio.open_connection(where.hostname, where.port)
    while (now := time.perf_counter()) < until:
        try:
            ok = await exchange(reader, writer, request(where.netloc, rows, rng)) == 200
        except (OSError, asyncio.IncompleteReadError, ValueError, StopIteration):
            ok = False
            writer.close()
            reader, writer = await asyncio.open_connection(where.hostname, where.port)
        if now >= warm:  # requests started in the warm-up are not counted
            out["latency" if ok else "errors"].append(time.perf_counter() - now)
    writer.close()


async def main(
    url: str, clients: int, seconds: float, warmup: float, rows: list[dict[str, Any]]
) -> dict[str, Any]:
    out: dict[str, list[float]] = {"latency": [], "errors": []}
    start = time.perf_counter()
    warm, until = start + warmup, start + warmup + seconds
    await asyncio.gather(*(client(url, rows, until, warm, out) for _ in range(clients)))
    measured = time.perf_counter() - warm
    lat = sorted(out["latency"])
    q = statistics.quantiles(lat, n=100) if len(lat) > 1 else lat * 99
    return {
        "clients": clients,
        "requests": len(lat),
        "errors": len(out["errors"]),
        "seconds": round(measured, 3),
        "rps": len(lat) / measured,
        "p50_ms": q[49] * 1000,
        "p99_ms": q[98] * 1000,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url")
    parser.add_argument("--clients", type=int, default=1)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--rows-file", type=Path, required=True)
    args = parser.parse_args()
    rows = json.loads(args.rows_file.read_text())
    print(json.dumps(asyncio.run(main(args.url, args.clients, args.seconds, args.warmup, rows))))
