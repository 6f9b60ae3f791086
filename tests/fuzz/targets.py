"""Every fuzz target by name, imported only when asked for (``load``): a run instruments what it imports."""

from __future__ import annotations

import importlib

from tests.fuzz._harness import Target

MODULES = {  # target name → the module defining it (as NAME.upper())
    "wire": "tests.fuzz.wire_targets",
    "secagg": "tests.fuzz.wire_targets",
    "config": "tests.fuzz.file_targets",
    "manifest": "tests.fuzz.file_targets",
    "table": "tests.fuzz.file_targets",
    "ablog": "tests.fuzz.ab_targets",
    "contract": "tests.fuzz.remote_targets",
    "notice": "tests.fuzz.remote_targets",
    "payload": "tests.fuzz.payload_targets",
}


def load(name: str) -> Target:
    """The target ``name``; KeyError naming the known ones otherwise."""
    if name not in MODULES:
        raise KeyError(f"unknown fuzz target {name!r}; one of {', '.join(MODULES)}")
    target: Target = getattr(importlib.import_module(MODULES[name]), name.upper())
    return target
