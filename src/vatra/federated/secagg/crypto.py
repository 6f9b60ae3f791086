"""Primitives of secure aggregation: X25519 + HKDF, ChaCha20-Poly1305, an AES-CTR PRG, Shamir sharing.

All from the ``cryptography`` package (OpenSSL); Shamir is arithmetic in the prime field
GF(2^256 + 297), the smallest prime field that holds a 32-byte secret in one share. Rebuilt
secrets are checked against what their owner published before masking (a SHA-256 commitment of
the self-mask seed, the X25519 public key of the mask key); when the check fails,
:func:`decode_shares` (Berlekamp–Welch) finds the holders whose shares are off the polynomial.
"""

from __future__ import annotations

import hashlib
import operator
import os
import secrets
from functools import lru_cache
from typing import Literal

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

PRIME = 2**256 + 297  # the smallest prime above 2^256: the Shamir field
SECRET_BYTES = 32
SHARE_BYTES = 33  # a field element, big-endian
NONCE_BYTES = 12
SEALED_BYTES = NONCE_BYTES + 2 * SHARE_BYTES + 16  # a sealed pair of shares: nonce ‖ ciphertext ‖ tag
PrgKind = Literal["aes-ctr", "chacha20"]


class SecAggError(RuntimeError):
    """A protocol message that fails authentication or breaks the protocol's rules."""


class SecretError(SecAggError):
    """Secret ``index`` of a batch (:func:`reconstruct_many`) could not be rebuilt."""

    def __init__(self, index: int, reason: str) -> None:
        super().__init__(reason)
        self.index = index


# ------------------------------------------------------------------ keys
def new_keypair() -> tuple[bytes, bytes]:
    """(private, public) raw 32-byte X25519 keys."""
    sk = X25519PrivateKey.generate()
    return sk.private_bytes_raw(), sk.public_key().public_bytes_raw()


class KeyAgreement:
    """One X25519 private key, loaded once (loading costs as much as an exchange), for many peers."""

    def __init__(self, private: bytes) -> None:
        self._sk = X25519PrivateKey.from_private_bytes(private)

    def derive(self, public: bytes, info: bytes) -> bytes:
        """X25519 shared secret, stretched by HKDF-SHA256 into a 32-byte key bound to ``info``."""
        shared = self._sk.exchange(X25519PublicKey.from_public_bytes(public))
        return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(shared)


def public_key(private: bytes) -> bytes:
    """The raw X25519 public key of a raw private key (to check a rebuilt key against the advertised one)."""
    return X25519PrivateKey.from_private_bytes(private).public_key().public_bytes_raw()


def commitment(secret: bytes, context: bytes) -> bytes:
    """SHA-256 of ``context ‖ secret``: binding, and hiding for a uniformly random 32-byte secret."""
    return hashlib.sha256(context + secret).digest()


def agree(private: bytes, public: bytes, info: bytes) -> bytes:
    """One-off :meth:`KeyAgreement.derive`."""
    return KeyAgreement(private).derive(public, info)


# ------------------------------------------------------------ encryption
def seal(key: bytes, plaintext: bytes, aad: bytes) -> bytes:
    """ChaCha20-Poly1305: nonce ‖ ciphertext ‖ tag; ``aad`` binds sender, receiver and round."""
    nonce = os.urandom(NONCE_BYTES)
    return nonce + ChaCha20Poly1305(key).encrypt(nonce, plaintext, aad)


def open_sealed(key: bytes, blob: bytes, aad: bytes) -> bytes:
    try:
        return ChaCha20Poly1305(key).decrypt(blob[:NONCE_BYTES], blob[NONCE_BYTES:], aad)
    except (InvalidTag, ValueError):
        raise SecAggError("share ciphertext failed authentication (tampered or misrouted)") from None


# ------------------------------------------------------------------- PRG
_CHUNK = 1 << 20  # keystream bytes per cipher call: a fixed 1 MiB of zero plaintext, whatever the model size
_ZEROS = memoryview(bytes(_CHUNK))


def prg(seed: bytes, n: int, kind: PrgKind = "aes-ctr", out: np.ndarray | None = None) -> np.ndarray:
    """``n`` uniform uint32 words: the keystream of AES-256-CTR or ChaCha20 keyed by the 32-byte ``seed``.

    Every seed keys exactly one stream (fresh self-mask seeds, pairwise seeds bound by HKDF to
    the round and pair), so the fixed all-zero counter/nonce never repeats under one key. Words
    are full 32-bit; callers reduce mod 2^bits once, after summing. ``out`` (uint32, at least
    n + 4 words: the cipher may write up to a block past the end) is filled in place instead of
    allocating; the returned array is a view of its first ``n`` words.
    """
    if kind == "aes-ctr":
        enc = Cipher(algorithms.AES(seed), modes.CTR(bytes(16))).encryptor()
    elif kind == "chacha20":
        enc = Cipher(algorithms.ChaCha20(seed, bytes(16)), mode=None).encryptor()
    else:
        raise ValueError(f"unknown PRG {kind!r}")
    if out is None:
        out = np.empty(n + 4, dtype=np.uint32)
    elif out.dtype != np.uint32 or out.size < n + 4 or not out.flags.c_contiguous:
        raise ValueError("prg out= needs a contiguous uint32 array of at least n + 4 words")
    buf = memoryview(out).cast("B")  # type: ignore[arg-type]
    for start in range(0, 4 * n, _CHUNK):  # one stream: CTR/ChaCha20 carry on across calls
        size = min(_CHUNK, 4 * n - start)
        enc.update_into(_ZEROS[:size], buf[start : start + size + 15])
    return out[:n]


# ---------------------------------------------------------------- Shamir
def share(secret: bytes, xs: list[int], t: int) -> dict[int, int]:
    """Shares of ``secret`` at the points ``xs`` (distinct, ≥ 1); any ``t`` of them recover it."""
    if not 1 <= t <= len(xs):
        raise ValueError(f"threshold {t} must be in [1, {len(xs)}]")
    coeffs = [int.from_bytes(secret, "big")] + [secrets.randbelow(PRIME) for _ in range(t - 1)]
    out = {}
    for x in xs:
        acc = 0
        for c in reversed(coeffs):  # Horner
            acc = (acc * x + c) % PRIME
        out[x] = acc
    return out


def reconstruct(shares: dict[int, int], t: int) -> bytes:
    """Lagrange interpolation at 0 from the ``t`` shares {x: y} of lowest x."""
    if len(shares) < t:
        raise SecAggError(f"{len(shares)} share(s), threshold {t}")
    pts = sorted(shares.items())[:t]
    ys = np.frombuffer(b"".join(int_bytes(y) for _, y in pts), dtype=np.uint8)
    return reconstruct_many(tuple(x for x, _ in pts), ys.reshape(1, t, SHARE_BYTES))[0]


_PRIME_BYTES = np.frombuffer(PRIME.to_bytes(SHARE_BYTES, "big"), dtype=np.uint8)


def reconstruct_many(xs: tuple[int, ...], shares: np.ndarray) -> list[bytes]:
    """:func:`reconstruct` of m secrets all shared at the ``t`` points ``xs``, from their shares.

    ``shares`` is (m, t, SHARE_BYTES) uint8, big-endian: secret v's share at ``xs[i]`` is
    ``shares[v, i]``. The m weighted sums Σ_i ℓ_i(0)·y_iv take t multiplications instead of t·m
    (Kronecker substitution): holder i's m shares are packed into one integer with a slot per
    secret, wide enough that Σ_i ℓ_i·y_iv < t·PRIME² never carries into the next slot.
    """
    m, t, size = shares.shape
    if size != SHARE_BYTES or t != len(xs):
        raise ValueError(f"shares of shape {shares.shape} for {len(xs)} points")
    # every share < PRIME = 2^256 + 297: a first byte of 0, or of 1 (only ≥ 2^256) checked exactly
    lead = shares[:, :, 0].reshape(-1)
    for i in np.flatnonzero(lead).tolist():
        if lead[i] > 1 or int.from_bytes(shares[i // t, i % t].tobytes(), "big") >= PRIME:
            raise SecretError(i // t, "a share outside the Shamir field")
    slot = (2 * PRIME.bit_length() + t.bit_length() + 7) // 8  # bytes per secret in a packed integer
    if m == 1:  # nothing to pack
        flat = shares.tobytes()
        ys = (int.from_bytes(flat[i : i + SHARE_BYTES], "big") for i in range(0, len(flat), SHARE_BYTES))
    else:
        packed = np.zeros((t, m, slot), dtype=np.uint8)  # (holder, secret, big-endian slot)
        packed[:, :, slot - SHARE_BYTES :] = shares.transpose(1, 0, 2)
        ys = (int.from_bytes(packed[i].tobytes(), "big") for i in range(t))
    raw = sum(map(operator.mul, lagrange_at_zero(xs), ys)).to_bytes(m * slot, "big")
    out = []
    for v in range(m):
        secret = int.from_bytes(raw[v * slot : (v + 1) * slot], "big") % PRIME
        if secret >> (8 * SECRET_BYTES):
            raise SecretError(
                v, "the shares do not rebuild a 32-byte secret (corrupt or inconsistent shares)"
            )
        out.append(secret.to_bytes(SECRET_BYTES, "big"))
    return out


def decode_shares(shares: dict[int, int], t: int) -> tuple[bytes, list[int]]:
    """The secret of a degree-(t − 1) sharing from ``shares`` {x: y}, and the x's of the wrong shares.

    Berlekamp–Welch: with m shares, up to e = ⌊(m − t)/2⌋ wrong ones are corrected. Find a monic
    E (degree e, zero at the wrong x's) and Q (degree < e + t) with Q(x) = y·E(x) at every share;
    then P = Q / E is the sharing polynomial. O(m³) field operations: for the rare rebuild that
    failed its check, never on the fast path. SecAggError if more than e shares are wrong.
    """
    pts = sorted(shares.items())
    m = len(pts)
    if m < t:
        raise SecAggError(f"{m} share(s), threshold {t}")
    e = (m - t) // 2
    width = 2 * e + t  # unknowns q_0 … q_{e+t−1}, E_0 … E_{e−1}
    rows = []
    for x, y in pts:
        powers = [1]
        for _ in range(e + t - 1):
            powers.append(powers[-1] * x % PRIME)
        rows.append(powers + [-y * powers[k] % PRIME for k in range(e)] + [y * powers[e] % PRIME])
    sol = _solve(rows, width)
    if sol is None:
        raise SecAggError(f"more than {e} of {m} shares are wrong: cannot decode")
    quotient, rest = _divide(sol[: e + t], [*sol[e + t :], 1])
    if any(rest):
        raise SecAggError(f"more than {e} of {m} shares are wrong: cannot decode")
    wrong = [x for x, y in pts if _evaluate(quotient, x) != y]
    if len(wrong) > e or quotient[0] >> (8 * SECRET_BYTES):
        raise SecAggError(f"more than {e} of {m} shares are wrong: cannot decode")
    return quotient[0].to_bytes(SECRET_BYTES, "big"), wrong


def _solve(rows: list[list[int]], width: int) -> list[int] | None:
    """A solution mod PRIME of the augmented system ``rows`` (free unknowns 0), or None if it has none."""
    rows = [r[:] for r in rows]
    pivots: list[int] = []
    r = 0
    for c in range(width):
        pivot = next((i for i in range(r, len(rows)) if rows[i][c]), None)
        if pivot is None:
            continue
        rows[r], rows[pivot] = rows[pivot], rows[r]
        inv = pow(rows[r][c], -1, PRIME)
        rows[r] = [v * inv % PRIME for v in rows[r]]
        for i in range(len(rows)):
            if i != r and rows[i][c]:
                f = rows[i][c]
                rows[i] = [(a - f * b) % PRIME for a, b in zip(rows[i], rows[r], strict=True)]
        pivots.append(c)
        r += 1
    if any(row[width] for row in rows[r:]):
        return None  # 0 = non-zero: inconsistent
    out = [0] * width
    for i, c in enumerate(pivots):
        out[c] = rows[i][width]
    return out


def _divide(num: list[int], den: list[int]) -> tuple[list[int], list[int]]:
    """Polynomials as coefficient lists (lowest first); ``den`` monic: (quotient, remainder) mod PRIME."""
    rest = num[:]
    quotient = [0] * max(1, len(num) - len(den) + 1)
    for i in range(len(num) - len(den), -1, -1):
        c = rest[i + len(den) - 1]
        quotient[i] = c
        for j, d in enumerate(den):
            rest[i + j] = (rest[i + j] - c * d) % PRIME
    return quotient, rest


def _evaluate(coeffs: list[int], x: int) -> int:
    acc = 0
    for c in reversed(coeffs):  # Horner
        acc = (acc * x + c) % PRIME
    return acc


@lru_cache(maxsize=256)
def lagrange_at_zero(xs: tuple[int, ...]) -> tuple[int, ...]:
    """ℓ_i(0) = Π_{j≠i} x_j / (x_j − x_i) for the points ``xs``, with one modular inverse for all.

    Cached: in full mode every secret of a round is rebuilt from the same set of survivors.
    """
    nums, dens = [], []
    for i, xi in enumerate(xs):
        num, den = 1, 1
        for j, xj in enumerate(xs):
            if i != j:
                num = num * xj % PRIME
                den = den * (xj - xi) % PRIME
        if den == 0:
            raise SecAggError(f"duplicate share point {xi}")
        nums.append(num)
        dens.append(den)
    # batch inversion (Montgomery's trick): prefix products, one pow(−1), then walk back
    prefix = [1]
    for d in dens:
        prefix.append(prefix[-1] * d % PRIME)
    inv = pow(prefix[-1], -1, PRIME)
    out = [0] * len(xs)
    for i in range(len(xs) - 1, -1, -1):
        out[i] = nums[i] * inv * prefix[i] % PRIME  # inv · prefix[i] = 1 / dens[i]
        inv = inv * dens[i] % PRIME
    return tuple(out)


def int_bytes(v: int) -> bytes:
    return v.to_bytes(SHARE_BYTES, "big")


def bytes_int(b: bytes) -> int:
    if len(b) != SHARE_BYTES:
        raise SecAggError(f"a share of {len(b)} bytes, expected {SHARE_BYTES}")
    v = int.from_bytes(b, "big")
    if v >= PRIME:
        raise SecAggError("a share outside the Shamir field")
    return v
