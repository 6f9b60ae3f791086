"""Which rows of a table are validation rows: ``data.split_column`` ("train"/"val"), a seeded
random share of an in-memory table (:func:`random_val`), or, for a stream that never holds the
whole table, a splitmix64 hash of ``(seed, global row index)`` below ``data.val_fraction``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from vatra.data.tabular.files import arrow
from vatra.errors import ConfigError

if TYPE_CHECKING:
    import pyarrow as pa


def split_values(col: Any) -> np.ndarray:
    """``data.split_column`` as a bool mask of validation rows; ConfigError on any other value."""
    pa = arrow()
    import pyarrow.compute as pc

    try:
        strings = pc.cast(col, pa.string())
    except pa.ArrowException as err:  # bytes that are not UTF-8 text, a type with no text form
        raise ConfigError(f"data.split_column: values must be the text 'train' or 'val' ({err})") from None
    found = [v for v in pc.unique(strings).to_pylist() if v not in ("train", "val")]
    if found:
        raise ConfigError(
            f"data.split_column: values must be 'train' or 'val'; found {sorted(map(str, found))[:5]}"
        )
    return np.asarray(pc.equal(strings, "val").to_numpy(zero_copy_only=False), dtype=bool)


def random_val(n: int, fraction: float, seed: int) -> np.ndarray:
    """A seeded random ``fraction`` of ``n`` items (at least one each side) as a bool mask."""
    if n < 2:
        raise ConfigError(f"data.val_fraction: {n} rows (or lists) cannot be split into train and val")
    n_val = min(max(round(n * fraction), 1), n - 1)
    mask = np.zeros(n, dtype=bool)
    mask[np.random.default_rng(seed).permutation(n)[:n_val]] = True
    return mask


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def _splitmix64(z: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser, elementwise and in place on uint64 (wrapping arithmetic)."""
    t = np.empty_like(z)
    with np.errstate(over="ignore"):
        for shift, mul in ((30, _MIX1), (27, _MIX2)):
            np.right_shift(z, np.uint64(shift), out=t)
            z ^= t
            z *= mul
        np.right_shift(z, np.uint64(31), out=t)
        z ^= t
    return z


def hashed_val(seed: int, start: int, n: int, fraction: float) -> np.ndarray:
    """Whether each global row ``start .. start + n - 1`` is a validation row: the top 53 bits of a
    splitmix64 hash of (seed, row index), read as a number in [0, 1), fall below ``fraction``."""
    key = _splitmix64(np.array([seed % 2**64], dtype=np.uint64))
    z = np.arange(start, start + n, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z *= _GOLDEN
        z += key
    z = _splitmix64(z)
    z >>= np.uint64(11)
    return z < np.uint64(int(fraction * 2**53))


@dataclass(frozen=True)
class SplitRule:
    """Which rows are validation rows: a split column, or the hashed share ``fraction``."""

    column: str
    fraction: float
    seed: int

    def val_rows(self, table: pa.Table | None, start: int, n: int) -> np.ndarray:
        if self.column:
            assert table is not None
            return split_values(table.column(self.column))
        return hashed_val(self.seed, start, n, self.fraction)
