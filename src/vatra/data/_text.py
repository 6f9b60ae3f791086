"""Byte-level text corpus built from this interpreter's own standard-library sources."""

from __future__ import annotations

import functools
import os
import sysconfig
from pathlib import Path

import numpy as np

# Tests are skipped because they are large, repetitive and vary most between Python builds.
_SKIP_DIRS = frozenset({"site-packages", "test", "tests", "__pycache__"})


def _stdlib_sources(root: Path) -> list[Path]:
    """Every ``.py`` file under ``root`` outside skipped folders, sorted by relative path."""
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        rel = Path(dirpath).relative_to(root)
        found.extend((rel / f).as_posix() for f in filenames if f.endswith(".py"))
    return [root / rel for rel in sorted(found)]


@functools.lru_cache(maxsize=4)
def stdlib_corpus(max_chars: int) -> np.ndarray:
    """The first ``max_chars`` bytes of the concatenated stdlib sources, as (T,) uint8.

    Cached per process: every rank builds the same corpus without touching the disk twice.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks: list[bytes] = []
    total = 0
    for path in _stdlib_sources(root):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_chars:
            break
    corpus = np.frombuffer(b"".join(chunks)[:max_chars], dtype=np.uint8)
    corpus.flags.writeable = False  # shared by every caller through the cache
    return corpus
