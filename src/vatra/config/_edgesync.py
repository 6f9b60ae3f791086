"""``[federated.edge]``: cloud-edge sync: what each device is sent, and error feedback on its uploads."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from vatra.config._sections import Section


class DeviceProfile(Section):
    """What one kind of edge device can hold and how fast it trains."""

    max_model_mb: float = Field(
        gt=0.0, description="Megabytes (10^6 bytes) the device may spend on the model it is sent."
    )
    speed: float = Field(
        1.0, gt=0.0, description="Relative training speed (1 = a median client; 0.25 = four times slower)."
    )


BUILTIN_PROFILES: dict[str, DeviceProfile] = {
    "laptop": DeviceProfile(max_model_mb=2000.0, speed=1.0),
    "phone": DeviceProfile(max_model_mb=50.0, speed=0.5),
    "raspberry": DeviceProfile(max_model_mb=16.0, speed=0.2),
}


class EdgeSyncConfig(Section):
    """Edge clients: a model sent as int8 where their device profile asks for it, uploads with error
    feedback (``federated.compression = "int8"`` or a sparsifier), ``[edge] qat`` in local training."""

    download: Literal["auto", "fp32", "int8"] = Field(
        "auto",
        description="The model sent to clients: fp32; int8 (one fp32 scale per row of each matrix, "
        "vectors in fp32: about 4x fewer bytes); auto = int8 only to clients whose device profile "
        "cannot hold the fp32 model.",
    )
    download_sparsity: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="int8 downloads: this share of the matrices' weights, smallest in magnitude (one "
        "threshold over all of them), is cut and not sent: a bitmask of the kept ones and their int8 "
        "values travel instead (0.5: about 0.63 bytes a weight instead of 1); 0 = dense.",
    )
    error_feedback: bool = Field(
        False,
        description="Each client keeps what federated.compression dropped from its update and adds it "
        "to its next round's update (EF-SGD), per client; needs federated.workers = 1 in simulation.",
    )
    profiles: list[str] = Field(
        [],
        description="Simulation: client c's device profile is entry c mod len; [] = no limits. "
        "Built-in: laptop (2000 MB, speed 1), phone (50 MB, 0.5), raspberry (16 MB, 0.2).",
    )
    device_profiles: dict[str, DeviceProfile] = Field(
        {},
        description="Profiles of your own, or the built-ins redefined: {name = {max_model_mb, speed}}.",
    )

    def profile(self, name: str) -> DeviceProfile:
        return self.device_profiles.get(name) or BUILTIN_PROFILES[name]

    @model_validator(mode="after")
    def _check(self) -> EdgeSyncConfig:
        known = sorted({*BUILTIN_PROFILES, *self.device_profiles})
        bad = [p for p in self.profiles if p not in known]
        if bad:
            raise ValueError(
                f"device profile {bad[0]!r} is not defined; choose one of {', '.join(known)} or add it "
                "to federated.edge.device_profiles"
            )
        return self
