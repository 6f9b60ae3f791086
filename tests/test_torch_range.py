"""pyproject.toml declares the PyTorch releases vatra supports: a range holding the one CI installs."""

from __future__ import annotations

import re
import tomllib

import torch
from packaging.requirements import Requirement
from packaging.version import Version
from tests._dist import ROOT


def _torch_requirement() -> Requirement:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["dependencies"]
    (req,) = [Requirement(d) for d in deps if Requirement(d).name == "torch"]
    return req


def test_declared_torch_range_holds_the_installed_and_the_makefile_release() -> None:
    # Prepare
    spec = _torch_requirement().specifier
    pinned = re.search(r"^TORCH := torch==(\S+)$", (ROOT / "Makefile").read_text(encoding="utf-8"), re.M)
    # Assert: what the suite runs under and what the Makefile installs are both inside the range
    assert pinned is not None, "the Makefile pins the torch release it installs first"
    assert Version(torch.__version__).base_version in spec, (torch.__version__, str(spec))
    assert pinned.group(1) in spec, (pinned.group(1), str(spec))


def test_declared_torch_range_is_a_range_not_a_pin() -> None:
    # Prepare
    spec = _torch_requirement().specifier
    # Assert: the oldest release with the APIs used is accepted, a release not yet tested is not
    assert not any(s.operator in ("==", "===", "~=") for s in spec), str(spec)
    assert "2.6.0" in spec and "2.5.1" not in spec and "3.0.0" not in spec, str(spec)
