"""The ``checkpoint`` and ``store`` sections: when to save full training state, and where it lives."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from vatra.config._sections import Section
from vatra.registry import STORE_BACKENDS, is_import_string


class CheckpointConfig(Section):
    # `async` is a Python keyword: the field is `async_`, read and written as `async` in TOML.
    model_config = ConfigDict(validate_by_name=True, validate_by_alias=True, serialize_by_alias=True)

    enabled: bool = Field(True, description="Save full training state (model, optimizer, RNG, sampler).")
    every_steps: int | Literal["auto"] = Field(
        25,
        description=(
            "Save every N optimizer steps (0 = only at the end and on SIGTERM); 'auto' picks the "
            "Young/Daly interval sqrt(2·MTBF·C) from the measured checkpoint cost C."
        ),
    )
    async_: bool = Field(
        False,
        alias="async",
        description="Serialize and upload on a background thread; training blocks only for the host copy.",
    )
    mtbf_s: float = Field(
        3600.0,
        gt=0.0,
        description="every_steps = 'auto': assumed mean time between failures until failures are observed.",
    )
    keep_last: int = Field(5, ge=0, description="Versions kept after each save (tagged ones too); 0 = all.")
    resume: bool = Field(True, description="Resume from the latest verified version when the store has one.")
    on_sigterm: bool = Field(True, description="On SIGTERM (preemption notice) save a checkpoint, then exit.")

    @model_validator(mode="after")
    def _check(self) -> CheckpointConfig:
        if isinstance(self.every_steps, int) and self.every_steps < 0:
            raise ValueError(f"every_steps must be ≥ 0 or 'auto' (got {self.every_steps})")
        return self


class ErasureConfig(Section):
    k: int = Field(4, ge=1, description="Shards needed to restore an object.")
    m: int = Field(6, ge=2, le=256, description="Shards written per object, one per node.")
    nodes: list[str] = Field(
        [], description="m storage locations (directories or fsspec URLs), one shard of every object each."
    )
    timeout_s: float = Field(
        120.0,
        gt=0.0,
        allow_inf_nan=False,
        description="Longest wait for one node's answer to one call (read, write, list, delete); a node "
        "slower than this counts as unreachable, like one that raises, for up to m − k nodes.",
    )

    @model_validator(mode="after")
    def _check(self) -> ErasureConfig:
        if self.k >= self.m:
            raise ValueError(f"need k < m (got k={self.k}, m={self.m})")
        if len(self.nodes) != self.m:
            raise ValueError(f"nodes: give exactly m={self.m} locations (got {len(self.nodes)})")
        if len(set(self.nodes)) != len(self.nodes):
            raise ValueError("nodes: locations must be distinct (a shared location defeats erasure coding)")
        return self


class StoreConfig(Section):
    """Where checkpoints live. ``backend`` picks the :class:`~vatra.resilience.StoreBackend`: the
    built-in fsspec or erasure backend, or a user's subclass named by import string, constructed as
    ``Class(url, options)`` (``url`` is ``store.url``, or ``<run>/checkpoints`` when that is empty)."""

    backend: str = Field(
        "auto",
        description="Store backend: auto (erasure when [store.erasure] is set, else fsspec), fsspec, "
        "erasure, or an import string 'package.module:Class' naming a vatra.resilience.StoreBackend "
        "subclass, constructed as Class(url, options) with store.url (or <run>/checkpoints) and "
        "store.options.",
    )
    url: str = Field(
        "",
        description="Store location: a directory or fsspec URL (s3://bucket/prefix); '' = <run>/checkpoints.",
    )
    options: dict[str, Any] = Field(
        {},
        description="Keyword options for the fsspec filesystem, e.g. {endpoint_url = 'http://…'} for S3 "
        "(passed as is to an import-string backend).",
    )
    erasure: ErasureConfig | None = Field(
        None, description="Erasure-code every object over several locations instead of using url."
    )
    hmac_key_env: str = Field(
        "",
        description="Name of an environment variable holding a key: manifests and tags are signed with "
        "HMAC-SHA256 when written and refused when unsigned or tampered on read ('' = unsigned; the "
        "store must then be trusted, since loading a checkpoint unpickles its metadata).",
    )

    @field_validator("hmac_key_env")
    @classmethod
    def _env_name(cls, value: str) -> str:
        if value and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", value):
            raise ValueError(
                f"{value!r} is not an environment variable name; give the variable's name "
                "(e.g. VATRA_STORE_KEY), not the key itself"
            )
        return value

    @field_validator("backend")
    @classmethod
    def _backend(cls, value: str) -> str:
        if value == "auto" or value in STORE_BACKENDS.builtins or is_import_string(value):
            return value
        raise ValueError(f"unknown store backend {value!r}; choose one of: auto, {STORE_BACKENDS.choices()}")

    @model_validator(mode="after")
    def _check(self) -> StoreConfig:
        if self.backend == "erasure" and self.erasure is None:
            raise ValueError("backend = 'erasure' needs a [store.erasure] section (k, m, nodes); add one")
        if self.backend == "fsspec" and self.erasure is not None:
            raise ValueError(
                "[store.erasure] is read by the erasure backend only; set store.backend = 'auto' or "
                "'erasure', or remove [store.erasure]"
            )
        return self
