"""Error feedback: what compression dropped this step is added to the next step's gradient."""

from __future__ import annotations

from collections.abc import Hashable

import torch


class Memory:
    """Residual accumulation (EF-SGD): ``e ← (g + e) − decompress(compress(g + e))``.

    Keyed by the caller (the DDP hook uses the parameter's ``id``). A residual whose shape no longer
    matches the tensor is dropped, not misapplied.
    """

    def __init__(self) -> None:
        self.residuals: dict[Hashable, torch.Tensor] = {}

    def accumulate(self, tensor: torch.Tensor, key: Hashable) -> torch.Tensor:
        """What a rank sends for ``tensor`` when it goes uncompressed (warm-up, small tensors)."""
        return tensor

    def compensate(self, tensor: torch.Tensor, key: Hashable) -> torch.Tensor:
        residual = self.residuals.get(key)
        if residual is None or residual.shape != tensor.shape:
            return tensor.clone()
        return tensor + residual

    def update(self, compensated: torch.Tensor, key: Hashable, transmitted: torch.Tensor) -> None:
        self.residuals[key] = compensated - transmitted

    def forget(self) -> None:
        """Drop what is remembered: the update this step's memory belonged to was skipped."""
        self.residuals.clear()

    def drop(self, key: Hashable) -> None:
        """Drop one tensor's state (a host member's, once it has handed it to its leader)."""
        self.residuals.pop(key, None)

    def residual_norm(self) -> float:
        return float(sum(r.float().norm() ** 2 for r in self.residuals.values()) ** 0.5)

    def state_dict(self) -> dict[str, dict[Hashable, torch.Tensor]]:
        """The per-tensor state by the caller's keys (a checkpoint renames them)."""
        return {"residuals": self.residuals}

    def load_state_dict(self, state: dict[str, dict[Hashable, torch.Tensor]]) -> None:
        self.residuals = dict(state.get("residuals", {}))


class NoMemory(Memory):
    """Error feedback off: nothing is remembered."""

    def compensate(self, tensor: torch.Tensor, key: Hashable) -> torch.Tensor:
        return tensor

    def update(self, compensated: torch.Tensor, key: Hashable, transmitted: torch.Tensor) -> None:
        return None


class MomentumMemory(Memory):
    """Momentum correction (DGC, Lin et al. ICLR'18): each rank keeps its own velocity
    ``u ← m·u + g`` and error feedback carries what was not sent *of the velocity*, so the optimizer
    must run without momentum of its own (the plugin turns it off).

    Why: with the optimizer's momentum applied after a sparse exchange, a coordinate that waits k
    steps in the residual arrives as one lump and is then smeared over ~1/(1−m) later steps; here it
    accumulates as momentum SGD would have moved it. With ``masking`` (momentum-factor masking, for
    sparsifiers) the velocity is cleared where a value was sent, so a sent lump does not keep pushing
    through stale momentum. Uncompressed tensors (warm-up, small ones) send the velocity itself:
    averaged over ranks, that is exactly momentum SGD on the averaged gradient.
    """

    def __init__(self, momentum: float, masking: bool) -> None:
        super().__init__()
        self.momentum = momentum
        self.masking = masking
        self.velocity: dict[Hashable, torch.Tensor] = {}

    def state_dict(self) -> dict[str, dict[Hashable, torch.Tensor]]:
        return {**super().state_dict(), "velocity": self.velocity}

    def forget(self) -> None:
        super().forget()
        self.velocity.clear()

    def drop(self, key: Hashable) -> None:
        super().drop(key)
        self.velocity.pop(key, None)

    def load_state_dict(self, state: dict[str, dict[Hashable, torch.Tensor]]) -> None:
        super().load_state_dict(state)
        self.velocity = dict(state.get("velocity", {}))

    def accumulate(self, tensor: torch.Tensor, key: Hashable) -> torch.Tensor:
        u = self.velocity.get(key)
        if u is None or u.shape != tensor.shape:
            u = self.velocity[key] = tensor.detach().clone()
        else:
            u.mul_(self.momentum).add_(tensor)
        return u

    def compensate(self, tensor: torch.Tensor, key: Hashable) -> torch.Tensor:
        return super().compensate(self.accumulate(tensor, key), key)

    def update(self, compensated: torch.Tensor, key: Hashable, transmitted: torch.Tensor) -> None:
        super().update(compensated, key, transmitted)
        if self.masking:
            self.velocity[key].masked_fill_(transmitted != 0, 0.0)
