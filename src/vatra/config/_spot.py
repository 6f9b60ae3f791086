"""The ``spot`` section: preemption notices of a live run on spot machines, and their risk."""

from __future__ import annotations

from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from vatra.config._sections import Section

# How long a provider lets a spot machine run after its notice (AWS: two minutes; GCP: 30 s).
NOTICE_WINDOW_S = {"aws": 120.0, "gcp": 30.0}


class SpotConfig(Section):
    """Where a preemption notice comes from besides SIGTERM, and how much time it leaves.

    A watcher thread (local rank 0 of each node) polls ``notice_url`` every ``poll_s`` and checks
    for ``notice_file``; on a notice every rank stops at the same step boundary, saves a checkpoint
    that must land within ``notice_s`` of the notice, and exits: 143 on the node that got the notice,
    75 on the others, which under ``--nnodes MIN:MAX`` re-form the group without it.
    """

    provider: Literal["aws", "gcp"] = Field(
        "aws",
        description="Shape of the metadata answer at notice_url: aws (spot/instance-action: 404, or 200 "
        "with JSON action and time) or gcp (instance/preempted: FALSE or TRUE, Metadata-Flavor: Google).",
    )
    notice_url: str = Field(
        "",
        description="Metadata endpoint to poll, e.g. http://169.254.169.254/latest/meta-data/spot/"
        "instance-action (aws) or http://metadata.google.internal/computeMetadata/v1/instance/"
        "preempted (gcp); '' = none.",
    )
    notice_file: str = Field("", description="A file whose appearance is a preemption notice; '' = none.")
    notice_s: float | None = Field(
        None,
        gt=0.0,
        description="Seconds from the notice to the machine's end, within which the checkpoint must land "
        "(default: 120 for aws, 30 for gcp).",
    )
    poll_s: float = Field(5.0, gt=0.0, description="Seconds between two polls of notice_url and notice_file.")
    mtbf_s: float | None = Field(
        None,
        gt=0.0,
        description="Mean time between preemptions of these machines, for checkpoint.every_steps = 'auto' "
        "until preemptions are observed (replaces checkpoint.mtbf_s when set).",
    )

    @field_validator("notice_url")
    @classmethod
    def _url(cls, value: str) -> str:
        if not value:
            return value
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(
                f"{value!r} is not an http(s) URL; give the metadata endpoint, e.g. "
                "http://169.254.169.254/latest/meta-data/spot/instance-action"
            )
        return value

    @model_validator(mode="after")
    def _no_credentials(self) -> SpotConfig:
        # a check on the section, not the field: its error does not echo the value (the secret)
        parts = urlsplit(self.notice_url)
        if parts.username or parts.password:
            raise ValueError(
                "spot.notice_url carries credentials, which config.toml and the logs would keep; "
                "remove them (metadata endpoints need none)"
            )
        return self

    def window_s(self) -> float:
        """Seconds a notice leaves: ``notice_s``, else the provider's."""
        return self.notice_s if self.notice_s is not None else NOTICE_WINDOW_S[self.provider]

    def watches(self) -> bool:
        return bool(self.notice_url or self.notice_file)
