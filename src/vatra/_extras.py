"""Optional dependencies: import one lazily, or fail with one line naming the extra that brings it."""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

from vatra.errors import ConfigError


class MissingExtra(ConfigError):
    """A feature the config or command asks for needs a package of an extra that is not installed."""


def _missing(module: str, extra: str, feature: str) -> MissingExtra:
    return MissingExtra(
        f"{feature} needs the package {module!r}, which is not installed: pip install 'vatra[{extra}]'"
    )


def check(module: str, extra: str, feature: str) -> None:
    """Fail with :class:`MissingExtra` unless ``module`` is installed, without importing it (an
    import of opacus alone costs seconds)."""
    if importlib.util.find_spec(module) is None:
        raise _missing(module, extra, feature)


def require(module: str, extra: str, feature: str) -> ModuleType:
    """``import module``; if it is missing, :class:`MissingExtra` says which extra installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise _missing(getattr(err, "name", None) or module, extra, feature) from None
