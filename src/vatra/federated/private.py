"""The private upload path, assembled: the DP hook with secure aggregation as its combiner.

:class:`PrivateUpload` is :class:`~vatra.federated.privacy.DPUpload` (clipping and noise on clients,
the accountant and the adaptive clip norm on the server) whose round sum comes from a
:class:`~vatra.federated.secagg.SecAggCombiner` (clients mask, the server unmasks only the sum)
when ``secure_aggregation.enabled``, else in the clear. Either works alone: DP without secure
aggregation, or secure aggregation with ``privacy.mode = "none"`` (the metric whitelist only).
"""

from __future__ import annotations

from typing import Any

from vatra.config import Config
from vatra.errors import ConfigError
from vatra.federated.privacy import DPUpload
from vatra.federated.secagg import ClientParty, SecAggCombiner
from vatra.rundir import RunDir

LINEAR = ("fedavg", "fedprox", "fedadam", "fedyogi")


def check_private_config(cfg: Config) -> None:
    """ConfigError when the strategy or compression cannot work with the mean of private uploads."""
    fc = cfg.federated
    if (fc.secure_aggregation.enabled or fc.privacy.mode == "client") and fc.strategy not in LINEAR:
        raise ConfigError(
            f"federated.strategy = {fc.strategy!r} needs every update; secure aggregation and "
            f"client-level DP give the mean only — use one of {', '.join(LINEAR)}"
        )
    if fc.strategy == "clustered":
        raise ConfigError(
            "federated.strategy = 'clustered' needs each client's cluster choice and loss, which "
            "secure aggregation and privacy keep on the client; use one of " + ", ".join(LINEAR)
        )
    if fc.compression != "none":
        raise ConfigError(
            f"federated.compression = {fc.compression!r} cannot be combined with secure aggregation or "
            "privacy (masked words and clipped, noised updates are not compressed); set it to 'none'"
        )


class PrivateUpload(DPUpload):
    """The DP hook; with secure aggregation its combiner sums the round. ``device``: a deployed
    client, which keeps its update and answers the protocol itself."""

    def __init__(self, cfg: Config, run_dir: RunDir | None = None, *, device: bool = False) -> None:
        check_private_config(cfg)
        super().__init__(cfg, run_dir)
        self.device = device
        self.secagg: SecAggCombiner | None = None
        if cfg.federated.secure_aggregation.enabled:
            self.secagg = SecAggCombiner(
                cfg,
                tail=self.count_coords,  # the clip count: masked and summed with the update
                tail_clip=self.count_clip,
                weighted=self.dp.mode != "client",  # client-level DP: the unweighted mean
                device=device,
                run_dir=run_dir,
            )
            self.combiner = self.secagg

    @property
    def party(self) -> ClientParty | None:
        """A deployed client's protocol endpoint (None before it trained, or without secure aggregation)."""
        return self.secagg.party if self.secagg is not None else None

    def __getstate__(self) -> dict[str, Any]:  # sent to client processes: the config only
        return {"cfg": self.cfg, "device": self.device}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["cfg"], device=state["device"])  # type: ignore[misc]


def build_private_hook(
    cfg: Config, run_dir: RunDir | None = None, *, device: bool = False
) -> PrivateUpload | None:
    """The private upload path when secure aggregation or DP is on; None otherwise."""
    if cfg.federated.secure_aggregation.enabled or cfg.federated.privacy.mode != "none":
        return PrivateUpload(cfg, run_dir, device=device)
    return None
