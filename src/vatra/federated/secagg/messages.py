"""Secure-aggregation messages on the wire: safetensors blobs like every other federated message.

Numpy arrays (masked vectors, uint32 words) travel as tensors. A :class:`BytesTable` — client id →
bytes of one length (public keys, sealed shares, revealed shares: the bulk of the key traffic,
n − 1 entries per client in full mode), or a dict of that form — travels as two tensors, the ids
(int64) and the bytes as one uint8 matrix, and is unpacked as a :class:`BytesTable` over them, so
neither side walks it item by item. Other bytes travel hex-encoded in the JSON metadata, other
dicts as ``[[key, value], …]``.

Unpacking does not copy tensors out of the message: they are read-only numpy views of the
received bytes (:func:`vatra.federated.wire.decode_views`; a masked vector is only read, summed
into the total), with every header entry checked against the blob's bounds.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from vatra.federated.wire import WireError, decode_views, encode


def pack(stage: str, rnd: int, msg: dict[str, Any]) -> bytes:
    tensors: dict[str, np.ndarray] = {}

    def enc(v: Any) -> Any:
        if isinstance(v, bytes):
            return {"$b": v.hex()}
        if isinstance(v, np.ndarray):
            name = f"t{len(tensors)}"
            tensors[name] = v
            return {"$t": name}
        if isinstance(v, BytesTable) or (isinstance(v, dict) and _id_bytes(v)):
            table = BytesTable.from_dict(v)
            ids, name = f"t{len(tensors)}", f"t{len(tensors) + 1}"
            tensors[ids], tensors[name] = table.ids, table.rows
            return {"$kb": [ids, name]}
        if isinstance(v, dict):
            return {"$d": [[enc(k), enc(x)] for k, x in v.items()]}
        if isinstance(v, (list, tuple)):
            if set(map(type, v)) <= {int}:  # client ids: plain JSON, no walk
                return list(v)
            return [enc(x) for x in v]
        if isinstance(v, (int, float, str)) or v is None:
            return v
        raise TypeError(f"cannot pack {type(v).__name__}")

    return encode({"kind": "secagg", "stage": stage, "round": rnd, "body": enc(msg)}, tensors)


def unpack(blob: bytes) -> tuple[str, int, dict[str, Any]]:
    meta, tensors = decode_views(blob)
    if meta.get("kind") != "secagg":
        raise WireError("not a secure-aggregation message")

    def dec(v: Any) -> Any:
        if isinstance(v, dict):
            if "$b" in v:
                return bytes.fromhex(v["$b"])
            if "$t" in v:
                return tensors[v["$t"]]
            if "$d" in v:
                return {dec(k): dec(x) for k, x in v["$d"]}
            if "$kb" in v:
                return BytesTable(tensors[v["$kb"][0]], tensors[v["$kb"][1]])
            raise WireError("unknown tagged value in a secure-aggregation message")
        if isinstance(v, list):
            if set(map(type, v)) <= {int}:
                return v
            return [dec(x) for x in v]
        return v

    try:
        return str(meta["stage"]), int(meta["round"]), dec(meta["body"])
    except (KeyError, TypeError, ValueError, IndexError) as err:
        raise WireError(f"malformed secure-aggregation message: {err}") from None


def _id_bytes(d: dict[Any, Any]) -> bool:
    """A non-empty {int: bytes} with every value of one non-zero length."""
    if not d or set(map(type, d)) != {int} or set(map(type, d.values())) != {bytes}:  # C loops, not a walk
        return False
    sizes = set(map(len, d.values()))
    return len(sizes) == 1 and 0 not in sizes


class BytesTable(Mapping[int, bytes]):
    """{client id: bytes of one length} as two arrays: ``ids`` (int64, (m,)) and ``rows`` (uint8, (m, size)).

    The server routes and collects keys and shares on the arrays, without a Python object per
    entry; reading the table as a mapping (the clients do) slices the rows into a dict once.
    """

    def __init__(self, ids: np.ndarray, rows: np.ndarray) -> None:
        if ids.dtype != np.int64 or rows.dtype != np.uint8 or ids.ndim != 1 or rows.ndim != 2:
            raise WireError("malformed id → bytes table in a secure-aggregation message")
        if rows.shape[0] != ids.size or len(set(ids.tolist())) != ids.size:
            raise WireError("id → bytes table: ids and rows do not match one to one")
        self.ids, self.rows = ids, rows
        self._dict: dict[int, bytes] | None = None
        self._order: np.ndarray | None = None  # argsort of ids, for take

    @classmethod
    def from_dict(cls, table: Mapping[int, bytes]) -> BytesTable:
        """A table of ``{int: bytes}`` (all values of one length); a BytesTable is returned as it is."""
        if isinstance(table, BytesTable):
            return table
        if not isinstance(table, Mapping) or not (set(map(type, table)) <= {int}):
            raise WireError("an id → bytes table needs int keys")
        if not (set(map(type, table.values())) <= {bytes}) or len(set(map(len, table.values()))) > 1:
            raise WireError("an id → bytes table needs bytes values of one length")
        size = len(next(iter(table.values()))) if table else 0
        ids = np.fromiter(table.keys(), dtype=np.int64, count=len(table))
        return cls(ids, np.frombuffer(b"".join(table.values()), dtype=np.uint8).reshape(len(table), size))

    @property
    def width(self) -> int:
        """Bytes per entry."""
        return int(self.rows.shape[1])

    def take(self, cids: Sequence[int]) -> BytesTable:
        """The entries of ``cids``, in that order; KeyError if one is missing."""
        want = np.asarray(cids, dtype=np.int64).reshape(-1)
        if self._order is None:
            self._order = np.argsort(self.ids)
        order = self._order
        at = np.searchsorted(self.ids, want, sorter=order)
        pos = order[at[at < len(order)]]
        if pos.size != want.size or not np.array_equal(self.ids[pos], want):
            raise KeyError(f"ids {sorted(set(want.tolist()) - set(self.ids.tolist()))} not in the table")
        return BytesTable(want, self.rows[pos])

    def as_dict(self) -> dict[int, bytes]:
        if self._dict is None:
            raw, size = self.rows.tobytes(), self.width
            self._dict = {cid: raw[i * size : (i + 1) * size] for i, cid in enumerate(self.ids.tolist())}
        return self._dict

    def __getitem__(self, cid: int) -> bytes:
        return self.as_dict()[cid]

    def __iter__(self) -> Iterator[int]:
        return iter(self.as_dict())

    def __len__(self) -> int:
        return int(self.ids.size)

    def __repr__(self) -> str:
        return f"BytesTable({len(self)} × {self.width} bytes)"
