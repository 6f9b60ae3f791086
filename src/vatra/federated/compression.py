"""Optional update compression on the upload path, reusing ``vatra.comm`` compressors.

``federated.compression = "topk"`` (or fp16, bf16, randomk, onebit, qsgd, or a user's
``vatra.comm.Compressor`` subclass as ``"package.module:Class"``) compresses each parameter tensor
of a client's update with the compressor ``vatra.comm`` uses for gradients, configured by the
``[comm]`` section (``ratio``, ``levels``, ``min_numel``: smaller tensors travel
uncompressed). The payload travels instead of the dense update and the server rebuilds the update
before the shape/NaN checks and aggregation. With ``federated.edge.error_feedback`` each client
keeps what compression dropped from its update (per client and tensor, in the hook of the process
that trains it: a deployed client's own, or the simulation's single process) and adds it to its
next round's update, as the DDP hook does per step (EF-SGD).
"""

from __future__ import annotations

import numpy as np
import torch

from vatra.comm import Memory, NoMemory, build_compressor
from vatra.comm._base import Compressor, Ctx
from vatra.config import Config
from vatra.federated._base import FitIns, FitRes, UploadHook
from vatra.federated.params import ParamLayout
from vatra.federated.wire import WireError

_BF16 = ".bf16"  # numpy has no bfloat16: such payload tensors travel as int16 bit patterns


class CompressedUpload(UploadHook):
    name = "compressed"

    def __init__(self, cfg: Config, layout: ParamLayout) -> None:
        comm = cfg.comm.model_copy(update={"method": cfg.federated.compression})
        self.compressor: Compressor = build_compressor(comm, "federated.compression")
        self.min_numel = cfg.comm.min_numel
        self.layout = layout
        c = self.compressor
        self.feedback = cfg.federated.edge.error_feedback and c.error_feedback and not c.lossless
        self.memory: Memory = Memory() if self.feedback else NoMemory()  # keyed by (client, tensor)

    def _chunks(self, total: int) -> list[tuple[int, int, tuple[int, ...]]]:
        """(offset, size, shape) of each parameter tensor inside an update of ``total`` floats."""
        out, offset = [], 0
        for size, shape in zip(self.layout.sizes, self.layout.shapes, strict=True):
            if offset + size > total:
                break
            out.append((offset, size, shape))
            offset += size
        if offset != total:
            raise WireError(f"update of {total} floats does not end on a parameter boundary")
        return out

    def encode(self, res: FitRes, ins: FitIns) -> FitRes:
        payload: dict[str, np.ndarray] = {}
        for i, (offset, size, shape) in enumerate(self._chunks(res.update.size)):
            key = (res.client_id, i)
            chunk = self.memory.compensate(
                torch.from_numpy(res.update[offset : offset + size].copy()).view(shape), key
            )
            if size < self.min_numel:
                payload[f"{i}.raw"] = chunk.reshape(-1).numpy()
                self.memory.drop(key)  # sent whole: nothing left over
                continue
            parts, ctx = self.compressor.compress(chunk)
            if self.feedback:  # what the server will rebuild; the rest waits for the next round
                self.memory.update(chunk, key, self.compressor.decompress(parts, ctx))
            for j, p in enumerate(parts):
                if p.dtype == torch.bfloat16:
                    payload[f"{i}.{j}{_BF16}"] = p.view(torch.int16).numpy()
                else:
                    payload[f"{i}.{j}"] = p.numpy()
        res.metrics["update_floats"] = int(res.update.size)
        res.payload, res.update = payload, np.zeros(0, dtype=np.float32)
        return res

    def decode(self, res: FitRes) -> FitRes:
        if not res.payload:
            return res  # sent dense
        try:
            total = int(res.metrics["update_floats"])
            chunks = self._chunks(total)  # checks the size against the model before allocating
            update = np.empty(total, dtype=np.float32)
            for i, (offset, size, shape) in enumerate(chunks):
                if f"{i}.raw" in res.payload:
                    update[offset : offset + size] = res.payload[f"{i}.raw"]
                    continue
                parts = []  # torch.tensor copies: the payload is a read-only view of the message
                for j in range(len(res.payload)):
                    if f"{i}.{j}" in res.payload:
                        parts.append(torch.tensor(res.payload[f"{i}.{j}"]))
                    elif f"{i}.{j}{_BF16}" in res.payload:
                        parts.append(torch.tensor(res.payload[f"{i}.{j}{_BF16}"]).view(torch.bfloat16))
                    else:
                        break
                dense = self.compressor.decompress(parts, Ctx(torch.Size(shape), torch.float32))
                update[offset : offset + size] = dense.reshape(-1).numpy()
        except WireError:
            raise
        except Exception as err:  # a malformed payload must reject the update, not crash the server
            raise WireError(f"undecodable compressed update: {type(err).__name__}: {err}") from None
        res.update, res.payload = update, {}
        return res


def build_upload_hook(cfg: Config, layout: ParamLayout) -> UploadHook:
    """The upload path the config asks for: identity, or compression with a ``vatra.comm`` compressor."""
    if cfg.federated.compression == "none":
        return UploadHook()
    return CompressedUpload(cfg, layout)
