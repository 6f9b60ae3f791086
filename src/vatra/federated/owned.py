"""Simulated owners whose rows come from their own source (``federated.client_data``), read only
when the client is selected and dropped after.

Two forms: an import string ``pkg.mod:client_data`` called as ``client_data(cid)`` (plus ``seed``
when it declares it) returning the client's ``(train, val)`` or ``(train, val, spec)`` datasets;
or a folder with one data file per owner (csv, parquet, npz... any file ``--data`` reads), client
``c`` being the ``c``-th file in name order. The ``[data]`` section still gives the model's input
spec and the server's own held-out data (its validation split); a client whose data does not fit
that spec fails with a one-line error naming it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from vatra.config import Config
from vatra.data import DatasetSpec, build_dataset
from vatra.data.infer import user_datasets
from vatra.errors import ConfigError
from vatra.federated.data import (
    ClientData,
    Federation,
    build_federation,
    data_context,
    load_source,
    own_data,
)
from vatra.registry import call_with, import_object, is_import_string

KEY = "federated.client_data"


@dataclass
class OwnedFederation:
    """Owners read from their own source; nothing of a client exists until :meth:`client_data`."""

    spec: DatasetSpec
    server_val: Any | None
    num_clients: int
    read: Callable[[int], ClientData]

    @property
    def val_sizes(self) -> np.ndarray:
        """Unknown until a client is read: every client counts as holding rows out (one that holds
        none reports 0 examples)."""
        return np.ones(self.num_clients, dtype=np.int64)

    def client_data(self, client: int) -> ClientData:
        data = self.read(client)
        if tuple(data.spec.input_shape) != tuple(self.spec.input_shape):
            raise ConfigError(
                f"{KEY}: client {client}'s inputs have shape {tuple(data.spec.input_shape)}, the model "
                f"(from [data]) takes {tuple(self.spec.input_shape)}; make them agree"
            )
        return data

    def partition_json(self) -> str | None:
        """None: the owners' rows are their own, not a partition of one dataset."""
        return None


def build_owners(cfg: Config) -> Federation | OwnedFederation:
    """A simulation's owners: a partition of ``[data]`` (:func:`build_federation`), or the sources
    ``federated.client_data`` names (checked now; each client read when it is selected)."""
    if not cfg.federated.client_data:
        return build_federation(cfg)
    _, server_val, spec = build_dataset(cfg.data, data_context(cfg))
    return owned_federation(cfg, spec, server_val)


def owned_federation(cfg: Config, spec: DatasetSpec, server_val: Any | None) -> OwnedFederation:
    """The owners ``federated.client_data`` names."""
    source, clients = cfg.federated.client_data, cfg.federated.clients
    if is_import_string(source) and not Path(source).exists():
        fn = import_object(source, KEY)
        if not callable(fn):
            raise ConfigError(f"{KEY}: {source!r} is not a function client_data(cid)")

        def read(c: int) -> ClientData:
            out = call_with(fn, {"cid": c}, {"seed": cfg.run.seed}, KEY)
            return own_data(user_datasets(out, source, cfg.train.task, KEY), f"{KEY} (client {c})")

        return OwnedFederation(spec, server_val, clients, read)
    folder = Path(source).expanduser()
    if not folder.is_dir():
        raise ConfigError(f"{KEY} {source}: neither an import string 'pkg.mod:client_data' nor a folder")
    files = sorted(p for p in folder.iterdir() if p.is_file() and not p.name.startswith("."))
    if len(files) != clients:
        raise ConfigError(
            f"{KEY}: {folder} holds {len(files)} files but federated.clients = {clients}; "
            f"set clients = {len(files)} (one file per owner)"
        )

    def read_file(c: int) -> ClientData:
        return own_data(load_source(cfg, str(files[c]), f"{KEY} (client {c})"), f"{KEY} {files[c].name}")

    return OwnedFederation(spec, server_val, clients, read_file)
