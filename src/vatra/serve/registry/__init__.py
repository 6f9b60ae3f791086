"""The model registry: immutable content-addressed versions of model folders, aliases with history."""

from vatra.serve.registry._records import AliasMove, ModelVersion, RegistryError, RegistryUsageError
from vatra.serve.registry.core import Registry, default_uri, key_from_env

__all__ = [
    "AliasMove",
    "ModelVersion",
    "Registry",
    "RegistryError",
    "RegistryUsageError",
    "default_uri",
    "key_from_env",
]
