"""Every fuzz target by name: ``TARGETS[name]`` is a :class:`~tests.fuzz._harness.Target`."""

from __future__ import annotations

from tests.fuzz._harness import Target
from tests.fuzz.file_targets import CONFIG, MANIFEST, TABLE
from tests.fuzz.wire_targets import SECAGG, WIRE

TARGETS: dict[str, Target] = {t.name: t for t in (WIRE, SECAGG, CONFIG, MANIFEST, TABLE)}
