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

import numpy as np
import torch

from vatra.comm.int8 import dequantize_rows, quantize_rows
from vatra.config import Config
from vatra.config._edgesync import BUILTIN_PROFILES, DeviceProfile
from vatra.errors import ConfigError

Shapes = tuple[tuple[int, ...], ...]
MB = 1e6
MAX_NAME = 64  # characters of a profile name a joining client may send


def int8_bytes(shapes: Shapes) -> int:
    """Bytes of an int8 download: 1 a matrix element and 4 a row; 4 a vector element."""
    total = 0
    for shape in shapes:
        n = int(np.prod(shape))
        total += n + 4 * shape[0] if len(shape) >= 2 else 4 * n
    return total


def pack_int8(vec: np.ndarray, shapes: Shapes, prefix: str) -> dict[str, np.ndarray]:
    """``vec`` (flat float32 weights) as ``{prefix.j.q: int8 (rows, ...), prefix.j.s: fp32 (rows,)}``
    for each matrix j and ``{prefix.j: fp32}`` for each vector."""
    out: dict[str, np.ndarray] = {}
    offset = 0
    for j, shape in enumerate(shapes):
        n = int(np.prod(shape))
        chunk = vec[offset : offset + n]
        offset += n
        if len(shape) >= 2:
            q, scale = quantize_rows(torch.from_numpy(np.ascontiguousarray(chunk)).view(shape))
            out[f"{prefix}.{j}.q"], out[f"{prefix}.{j}.s"] = q.numpy(), scale.numpy()
        else:
            out[f"{prefix}.{j}"] = chunk
    return out


def unpack_int8(tensors: dict[str, np.ndarray], prefix: str, chunks: int) -> np.ndarray:
    """The flat float32 weights :func:`pack_int8` packed (dequantized); KeyError when one is missing."""
    parts = []
    for j in range(chunks):
        if f"{prefix}.{j}" in tensors:
            parts.append(np.asarray(tensors[f"{prefix}.{j}"], dtype=np.float32).reshape(-1))
            continue
        q, scale = tensors[f"{prefix}.{j}.q"], tensors[f"{prefix}.{j}.s"]
        if q.dtype != np.int8 or q.ndim < 2 or scale.shape != (q.shape[0],):
            raise ValueError(f"{prefix}.{j}: int8 values need one fp32 scale per row")
        dense = dequantize_rows(torch.from_numpy(q.copy()), torch.from_numpy(scale.astype(np.float32)))
        parts.append(dense.reshape(-1).numpy())
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
        self.int8_bytes = int8_bytes(shapes)
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

    def shapes_for(self, client: int) -> Shapes | None:
        """The layout to pack ``client``'s download in int8 with, or None to send it in fp32."""
        return self.shapes if self.form(client) == "int8" else None

    def speed(self, client: int) -> float:
        known = self.profile(client)
        return known[1].speed if known else 1.0
