"""What a fuzz target is, and the small seeded mutator the test suite uses where libFuzzer does not run.

A target's ``test_one_input(data)`` feeds ``data`` to a decoder and returns when the decoder
accepted it or refused it with its own error type; anything else (another exception type, a hang
caught by ``-timeout``, memory past ``-rss_limit_mb``) is a finding. The same function runs under
atheris (``python -m tests.fuzz.run``, ``bench/fuzz.py``) and, over its seeds and seeded
mutations of them, in ``tests/test_fuzz.py``.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Target:
    """One fuzz target: the property check, its seed corpus and the libFuzzer dictionary tokens."""

    name: str
    test_one_input: Callable[[bytes], None]
    seeds: Callable[[], list[bytes]]  # real, valid inputs built by the encoders (no binary files kept)
    tokens: Sequence[bytes] = field(default=())  # written as a libFuzzer -dict file; the mutator inserts them
    findings: Callable[[], list[bytes]] = list  # inputs that once broke the property: kept as seeds and tests


def mutations(seeds: Sequence[bytes], tokens: Sequence[bytes], count: int, seed: int = 0) -> Iterator[bytes]:
    """``count`` inputs, each a seed after one to four byte flips, token insertions, cuts, copies,
    splices with another seed or integer edits (the moves libFuzzer makes, without its coverage)."""
    rng = random.Random(seed)
    words = [*tokens, b"\x00", b"\xff", b"-1", b"0", b"9" * 20, b"1e999", b"[", b"{", b'"', b"\\"]
    for _ in range(count):
        data = bytearray(rng.choice(seeds))
        for _ in range(rng.randint(1, 4)):
            at = rng.randint(0, len(data))
            move = rng.randrange(7)
            if move == 0 and data:
                data[min(at, len(data) - 1)] = rng.randrange(256)
            elif move == 1:
                data[at:at] = rng.choice(words) * rng.choice((1, 1, 2, 40))
            elif move == 2:
                del data[at : at + rng.randint(1, 64)]
            elif move == 3 and data:
                lo = rng.randrange(len(data))
                data[at:at] = data[lo : lo + rng.randint(1, 64)]
            elif move == 4:
                other = rng.choice(seeds)
                data = data[:at] + other[rng.randint(0, len(other)) :]
            elif move == 5:
                data = data[: rng.randint(0, len(data))]
            else:  # a number's digits: a size or an offset off by a little or by a lot
                digits = [i for i, b in enumerate(data) if 0x30 <= b <= 0x39]
                if digits:
                    i = rng.choice(digits)
                    data[i : i + 1] = str(rng.choice((0, 1, 7, 2**31, 2**63, 10**30))).encode()
        yield bytes(data)


TAIL = bytes(range(256)) * 8  # 2 kB of tensor bytes under a fuzzed safetensors header


def _parts(blob: bytes) -> tuple[bytes, bytes]:
    """(header JSON, tensor bytes) of a safetensors message."""
    n = int.from_bytes(blob[:8], "little")
    return blob[8 : 8 + n], blob[8 + n :]


def framed(data: bytes, beside: Sequence[bytes]) -> bytes:
    """The message a fuzz input stands for. Its first byte picks the layer the fuzzer mutates, so that
    mutations reach the checks past the framing: 0, the message's raw bytes; 1, the safetensors header
    JSON (the length prefix and 2 kB of tensor bytes are added); 2 + i, the metadata JSON text, put
    under ``__metadata__.meta`` of the message ``beside[i]`` (its tensors stay valid)."""
    if not data:
        return data
    mode, body = data[0] % (2 + len(beside)), data[1:]
    if mode == 0:
        return body
    if mode == 1:
        return len(body).to_bytes(8, "little") + body + TAIL
    head, tensors = _parts(beside[mode - 2])
    header = json.loads(head)
    header["__metadata__"] = {"meta": body.decode("utf-8", "replace")}
    text = json.dumps(header).encode()
    return len(text).to_bytes(8, "little") + text + tensors


def frame_seeds(blobs: Sequence[bytes], beside: Sequence[bytes]) -> list[bytes]:
    """Each message as three seeds: raw, its header JSON, and its metadata beside the ``beside`` message
    whose tensor names match (the first, when none does)."""
    seeds = []
    for blob in blobs:
        head, _ = _parts(blob)
        header = json.loads(head)
        names = set(header) - {"__metadata__"}
        at = next(
            (i for i, b in enumerate(beside) if set(json.loads(_parts(b)[0])) - {"__metadata__"} == names), 0
        )
        seeds += [b"\x00" + blob, b"\x01" + head, bytes([2 + at]) + header["__metadata__"]["meta"].encode()]
    return seeds
