"""Cloud-edge sync: the model sent to each client as fp32 or int8, as its device profile allows.

An int8 download carries each matrix as int8 values with one fp32 scale per row
(:func:`vatra.comm.int8.quantize_rows`, the form torchao's per-row int8 weights take) and each
vector (biases, norms) in fp32. The client trains from the dequantized weights and uploads its
update relative to them, so the server's fp32 model never absorbs the rounding: the download's
error does not accumulate over rounds. A client's ``federated.edge.profiles`` entry caps the bytes
it may be sent: the fp32 model when it fits, else the int8 one, else the run is refused before
round 1 with the sizes named.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vatra.comm._base import pack_bits, unpack_bits
from vatra.comm.int8 import dequantize_rows, quantize_rows
from vatra.config import Config
from vatra.config._edgesync import BUILTIN_PROFILES, DeviceProfile
from vatra.errors import ConfigError

Shapes = tuple[tuple[int, ...], ...]
MB = 1e6
MAX_NAME = 64  # characters of a profile name a joining client may send


@dataclass(frozen=True)
class Int8Download:
    """How a model travels to a device: its parameter shapes and the share of matrix weights cut."""

    shapes: Shapes
    sparsity: float = 0.0

    def kept(self) -> int:
        """Matrix weights sent: all but the ``sparsity`` share (rounded as torch's L1Unstructured)."""
        total = sum(int(np.prod(s)) for s in self.shapes if len(s) >= 2)
        return total - round(self.sparsity * total)

    def nbytes(self) -> int:
        """Payload bytes: 4 a matrix row (scale) and 4 a vector element; dense: 1 a matrix element,
        pruned: 1 a kept element plus a bitmask of 1 bit an element."""
        total = 0
        for shape in self.shapes:
            n = int(np.prod(shape))
            if len(shape) < 2:
                total += 4 * n
            else:
                total += 4 * shape[0] + (n if self.sparsity == 0 else -(-n // 8) + 4 * len(shape))
        return total + (self.kept() if self.sparsity else 0)


def int8_bytes(shapes: Shapes, sparsity: float = 0.0) -> int:
    """Bytes of an int8 download (:meth:`Int8Download.nbytes`)."""
    return Int8Download(shapes, sparsity).nbytes()


def _matrix_mask(vec: np.ndarray, form: Int8Download) -> np.ndarray | None:
    """Bool (len(vec),): False on the ``sparsity`` share of matrix weights smallest in magnitude
    (one threshold over every matrix, as ``edge.prune = "magnitude"``); None when nothing is cut."""
    if form.sparsity == 0:
        return None
    is_matrix = np.concatenate(
        [np.full(int(np.prod(s)), len(s) >= 2) for s in form.shapes] or [np.zeros(0, dtype=bool)]
    )
    where = np.flatnonzero(is_matrix)
    scores = torch.from_numpy(np.abs(vec[where]))
    keep = np.zeros(len(vec), dtype=bool)
    keep[where[torch.topk(scores, form.kept(), sorted=False).indices.numpy()]] = True
    keep[~is_matrix] = True
    return keep


def pack_int8(vec: np.ndarray, form: Int8Download, prefix: str) -> dict[str, np.ndarray]:
    """``vec`` (flat float32 weights) as, per matrix j, ``prefix.j.q`` (int8, its shape) and
    ``prefix.j.s`` (fp32 scale per row); pruned (``form.sparsity``), ``prefix.j.m`` (bitmask of the
    kept weights), ``prefix.j.v`` (their int8 values) and ``prefix.j.shape`` instead of ``.q``; per
    vector j, ``prefix.j`` (fp32)."""
    out: dict[str, np.ndarray] = {}
    keep = _matrix_mask(vec, form)
    offset = 0
    for j, shape in enumerate(form.shapes):
        n = int(np.prod(shape))
        chunk = vec[offset : offset + n]
        if len(shape) < 2:
            out[f"{prefix}.{j}"] = chunk
        elif keep is None:
            q, scale = quantize_rows(torch.from_numpy(np.ascontiguousarray(chunk)).view(shape))
            out[f"{prefix}.{j}.q"], out[f"{prefix}.{j}.s"] = q.numpy(), scale.numpy()
        else:
            mask = torch.from_numpy(keep[offset : offset + n].copy())
            pruned = torch.from_numpy(np.ascontiguousarray(chunk)) * mask  # the cut weights at 0
            q, scale = quantize_rows(pruned.view(shape))
            out[f"{prefix}.{j}.m"] = pack_bits(mask).numpy()
            out[f"{prefix}.{j}.v"] = q.reshape(-1)[mask].numpy()
            out[f"{prefix}.{j}.s"] = scale.numpy()
            out[f"{prefix}.{j}.shape"] = np.asarray(shape, dtype=np.int32)
        offset += n
    return out


def _unpack_matrix(tensors: dict[str, np.ndarray], name: str) -> np.ndarray:
    scale = tensors[f"{name}.s"]
    if f"{name}.q" in tensors:
        q = tensors[f"{name}.q"]
    else:  # pruned: scatter the kept values into zeros
        shape = tuple(int(d) for d in tensors[f"{name}.shape"])
        n = int(np.prod(shape))
        if len(shape) < 2 or n > 2**40:
            raise ValueError(f"{name}: shape {shape} is no matrix the model could hold")
        mask = unpack_bits(torch.from_numpy(tensors[f"{name}.m"].copy()), n).numpy()
        values = tensors[f"{name}.v"]
        if values.dtype != np.int8 or values.shape != (int(mask.sum()),):
            raise ValueError(
                f"{name}: {values.shape} {values.dtype} values for {int(mask.sum())} kept weights"
            )
        q = np.zeros(n, dtype=np.int8)
        q[mask] = values
        q = q.reshape(shape)
    if q.dtype != np.int8 or q.ndim < 2 or scale.shape != (q.shape[0],):
        raise ValueError(f"{name}: int8 values need one fp32 scale per row")
    dense = dequantize_rows(torch.from_numpy(q.copy()), torch.from_numpy(scale.astype(np.float32)))
    return dense.reshape(-1).numpy()


def unpack_int8(tensors: dict[str, np.ndarray], prefix: str, chunks: int) -> np.ndarray:
    """The flat float32 weights :func:`pack_int8` packed (dequantized); KeyError when one is missing."""
    parts = []
    for j in range(chunks):
        if f"{prefix}.{j}" in tensors:
            parts.append(np.asarray(tensors[f"{prefix}.{j}"], dtype=np.float32).reshape(-1))
        else:
            parts.append(_unpack_matrix(tensors, f"{prefix}.{j}"))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.float32)


def profile_speeds(cfg: Config) -> np.ndarray:
    """(clients,) relative speed of each client's device profile (1 without profiles)."""
    edge, n = cfg.federated.edge, cfg.federated.clients
    if not edge.profiles:
        return np.ones(n)
    return np.array([edge.profile(edge.profiles[c % len(edge.profiles)]).speed for c in range(n)])


class EdgeSync:
    """Per client: its device profile, the form of the model it is sent, its relative speed."""

    def __init__(self, cfg: Config, shapes: Shapes, *, simulated: bool = True) -> None:
        self.edge = cfg.federated.edge
        self.simulated = simulated  # federated.edge.profiles applies; a deployment has declared ones only
        self.shapes = shapes
        self.fp32_bytes = 4 * sum(int(np.prod(s)) for s in shapes)
        self.int8 = Int8Download(shapes, self.edge.download_sparsity)
        self.int8_bytes = self.int8.nbytes()
        self.declared: dict[int, str] = {}  # deployment: the profile each client named when it joined

    def declare(self, client: int, name: object) -> str | None:
        """Deployment: ``client`` runs on profile ``name`` (``--device-profile``, from its join message);
        why it must be refused (not a profile name, an unknown one, or one that holds the model in no
        form), else None."""
        known = sorted({*BUILTIN_PROFILES, *self.edge.device_profiles})
        if not isinstance(name, str) or len(name) > MAX_NAME:
            return f"device_profile must be a profile name of at most {MAX_NAME} characters"
        if name not in known:
            return f"device profile {name!r} is not in the server's config; choose one of {', '.join(known)}"
        self.declared[client] = name
        try:
            self.form(client)
        except ConfigError as err:
            del self.declared[client]
            return str(err)
        return None

    def check_simulated(self, clients: int) -> None:
        """Refuse, before round 1, a simulated profile that cannot hold the model in any form."""
        for c in range(min(clients, len(self.edge.profiles))):  # each entry once
            self.form(c)

    def profile(self, client: int) -> tuple[str, DeviceProfile] | None:
        """``client``'s (profile name, profile): the one it declared (deployment), else its
        ``federated.edge.profiles`` entry (simulation), else None (no limits)."""
        names = self.edge.profiles if self.simulated else []
        name = self.declared.get(client) or (names[client % len(names)] if names else None)
        return None if name is None else (name, self.edge.profile(name))

    def form(self, client: int) -> str:
        """``fp32`` or ``int8``: what ``client`` is sent (ConfigError when its device holds neither)."""
        known = self.profile(client)
        cap = known[1].max_model_mb * MB if known else float("inf")
        if self.edge.download == "fp32" or (self.edge.download == "auto" and self.fp32_bytes <= cap):
            if self.fp32_bytes > cap:
                raise self._refusal(client, "fp32 (federated.edge.download = 'fp32')")
            return "fp32"
        if self.int8_bytes > cap:
            raise self._refusal(client, "int8")
        return "int8"

    def _refusal(self, client: int, smallest: str) -> ConfigError:
        name, prof = self.profile(client) or ("", None)
        assert prof is not None
        return ConfigError(
            f"client {client}'s device profile {name!r} holds {prof.max_model_mb:g} MB, but the model "
            f"is {self.fp32_bytes / MB:.3g} MB in fp32 and {self.int8_bytes / MB:.3g} MB in int8 "
            f"(the smallest it may be sent: {smallest}); raise federated.edge.device_profiles."
            f"{name}.max_model_mb or choose a smaller model"
        )

    def download(self, client: int) -> Int8Download | None:
        """How to pack ``client``'s download in int8, or None to send it in fp32."""
        return self.int8 if self.form(client) == "int8" else None

    def speed(self, client: int) -> float:
        known = self.profile(client)
        return known[1].speed if known else 1.0
