"""The root config, TOML loading, ``--set`` overrides and one-line error messages."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import tomli_w
from pydantic import Field, ValidationError

from vatra.config._chaos import ChaosConfig
from vatra.config._comm import CommConfig
from vatra.config._federated import FederatedConfig
from vatra.config._monitor import HealConfig, MonitorConfig
from vatra.config._resilience import CheckpointConfig, StoreConfig
from vatra.config._sections import (
    DataConfig,
    DistConfig,
    ModelConfig,
    OptimConfig,
    RunConfig,
    Section,
    TrainConfig,
)
from vatra.errors import ConfigError
from vatra.registry import add_import_paths


class Config(Section):
    """A whole run: one field per TOML section."""

    run: RunConfig = Field(default_factory=RunConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    dist: DistConfig = Field(default_factory=DistConfig)
    chaos: ChaosConfig = Field(default_factory=ChaosConfig)
    monitor: MonitorConfig = Field(default_factory=MonitorConfig)
    heal: HealConfig = Field(default_factory=HealConfig)
    comm: CommConfig = Field(default_factory=CommConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    store: StoreConfig = Field(default_factory=StoreConfig)
    federated: FederatedConfig = Field(default_factory=FederatedConfig)


def parse_override(item: str) -> tuple[list[str], Any]:
    """Split ``section.key=value``; the value is read as a TOML value, else kept as a string."""
    key, sep, raw = item.partition("=")
    path = [p.strip() for p in key.strip().split(".")]
    if not sep or len(path) < 2 or not all(path):
        raise ConfigError(f"--set {item!r}: expected section.key=value, e.g. --set train.steps=100")
    raw = raw.strip()
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # bare words such as digits or cosine
    return path, value


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Return ``raw`` with each ``section.key=value`` applied (nested dicts are created)."""
    for item in overrides:
        path, value = parse_override(item)
        node = raw
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"--set {item!r}: {part!r} is a value, not a section")
            node = child
        node[path[-1]] = value
    return raw


def _format_error(err: ValidationError) -> str:
    """One line: dotted path, what was wrong, what is allowed."""
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first["loc"])
    if first["type"] == "extra_forbidden":
        model: type[Section] = Config
        for part in first["loc"][:-1]:
            field = model.model_fields.get(str(part))
            if field is None or not isinstance(field.annotation, type):
                break
            model = field.annotation
        allowed = ", ".join(sorted(model.model_fields))
        msg = f"{loc}: unknown key; allowed keys here: {allowed}"
    else:
        text = first["msg"].removeprefix("Value error, ").removeprefix("Assertion failed, ")
        msg = f"{loc or 'config'}: {text} (got {first.get('input')!r})"
    more = len(err.errors()) - 1
    return msg + (f" [+{more} more]" if more else "")


def config_from_dict(raw: dict[str, Any], base_dir: str | Path | None = None) -> Config:
    """Validate a raw config; ``run.import_paths`` are read from ``base_dir`` (a config file's folder,
    which is also their default).

    The import paths go on ``sys.path`` here, so import strings in the config resolve in this
    process and in every worker that loads the resolved config from the run folder.
    """
    if base_dir is not None:
        run = raw.setdefault("run", {})
        if isinstance(run, dict):
            base = Path(base_dir).resolve()
            given = run.get("import_paths", ["."])  # default: the config file's own folder
            if isinstance(given, list) and all(isinstance(p, str) for p in given):
                run["import_paths"] = list(dict.fromkeys(str((base / p).resolve()) for p in given))
    try:
        cfg = Config.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_format_error(err)) from None
    add_import_paths(cfg.run.import_paths)
    return cfg


def load_config(path: str | Path | None, overrides: list[str] | None = None) -> Config:
    """Load a TOML file (or only defaults when ``path`` is None) and apply overrides."""
    raw: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p} (pass a TOML file such as examples/digits.toml)")
        try:
            raw = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"{p}: invalid TOML: {err}") from None
        _absolute_data_path(raw, p.parent)  # a path written in the file is read from the file's folder
    raw = apply_overrides(raw, overrides or [])
    _absolute_data_path(raw, Path.cwd())  # one given with --set, from the working directory
    return config_from_dict(raw, Path(path).parent if path is not None else None)


def _absolute_data_path(raw: dict[str, Any], base: Path) -> None:
    """Make relative local paths (``data.path``, ``federated.partition.file``) absolute against
    ``base`` (URLs such as s3:// stay)."""
    fed = raw.get("federated")
    part = fed.get("partition") if isinstance(fed, dict) else None
    for section, key in ((raw.get("data"), "path"), (part, "file")):
        if isinstance(section, dict) and isinstance(section.get(key), str) and section[key]:
            given = section[key]
            if "://" not in given and not Path(given).is_absolute():
                section[key] = str(base.resolve() / given)


def dump_toml(cfg: Config) -> str:
    """The resolved config as TOML (None values are left out: TOML has no null)."""
    return tomli_w.dumps(cfg.model_dump(mode="json", exclude_none=True))
