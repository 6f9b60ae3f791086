"""Primitives of secure aggregation: X25519 + HKDF, ChaCha20-Poly1305, a ChaCha20 PRG, Shamir sharing.

All from the ``cryptography`` package (OpenSSL); Shamir is arithmetic in the prime field
GF(2^521 − 1), large enough for a 32-byte secret in one share.
"""

from __future__ import annotations

import functools
import os
import secrets

import numpy as np
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat, PublicFormat

PRIME = 2**521 - 1  # Mersenne prime: the Shamir field
SECRET_BYTES = 32
NONCE_BYTES = 12


class SecAggError(RuntimeError):
    """A protocol message that fails authentication or breaks the protocol's rules."""


# ------------------------------------------------------------------ keys
def new_keypair() -> tuple[bytes, bytes]:
    """(private, public) raw 32-byte X25519 keys."""
    sk = X25519PrivateKey.generate()
    raw_sk = sk.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())
    return raw_sk, sk.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


def agree(private: bytes, public: bytes, info: bytes) -> bytes:
    """X25519 shared secret, stretched by HKDF-SHA256 into a 32-byte key bound to ``info``."""
    shared = X25519PrivateKey.from_private_bytes(private).exchange(X25519PublicKey.from_public_bytes(public))
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(shared)


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
def prg(seed: bytes, n: int, bits: int) -> np.ndarray:
    """``n`` uniform words of ``bits`` ≤ 32 bits (uint32) from a ChaCha20 keystream keyed by ``seed``."""
    enc = Cipher(algorithms.ChaCha20(seed, b"\x00" * 16), mode=None).encryptor()
    words = np.frombuffer(enc.update(bytes(4 * n)), dtype="<u4")  # read-only view, no copy
    return words if bits == 32 else words & np.uint32((1 << bits) - 1)


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
    """Lagrange interpolation at 0 from ``t`` shares {x: y}."""
    if len(shares) < t:
        raise SecAggError(f"{len(shares)} share(s), threshold {t}")
    pts = sorted(shares.items())[:t]
    coeffs = _lagrange_at_zero(tuple(x for x, _ in pts))
    secret = sum(y * c for (_, y), c in zip(pts, coeffs, strict=True)) % PRIME
    return secret.to_bytes(SECRET_BYTES, "big")


@functools.lru_cache(maxsize=64)
def _lagrange_at_zero(xs: tuple[int, ...]) -> tuple[int, ...]:
    """ℓ_i(0) for the points ``xs``; cached: most secrets of a round share one set of holders."""
    out = []
    for i, xi in enumerate(xs):
        num, den = 1, 1
        for j, xj in enumerate(xs):
            if i != j:
                num = num * (-xj) % PRIME
                den = den * (xi - xj) % PRIME
        out.append(num * pow(den, -1, PRIME) % PRIME)
    return tuple(out)


def int_bytes(v: int) -> bytes:
    return v.to_bytes(66, "big")  # 521 bits


def bytes_int(b: bytes) -> int:
    return int.from_bytes(b, "big")
