"""The search space: ``[tune.space]`` checked against the config model, suggested on an optuna trial,
and applied to the base run's config."""

from __future__ import annotations

import copy
import types
import typing
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from vatra.config import Config, ParamConfig, config_from_dict
from vatra.errors import ConfigError

if TYPE_CHECKING:
    import optuna


def _section_of(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model a field holds (``X`` or ``X | None``), else None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        for arg in typing.get_args(annotation):
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                return arg
    return None


def _is_mapping(annotation: Any) -> bool:
    return typing.get_origin(annotation) is dict or annotation is dict


def check_key(name: str) -> None:
    """``name`` is a dotted path to one config value (``optim.lr``; below a dict field such as
    ``model.kwargs.width`` any key goes); else a one-line error naming the valid keys there."""
    parts = name.split(".")
    model: type[BaseModel] = Config
    for depth, part in enumerate(parts):
        field = model.model_fields.get(part)
        where = ".".join(parts[:depth]) or "the config"
        if field is None or (depth == 0 and part == "tune"):
            valid = ", ".join(sorted(k for k in model.model_fields if k != "tune" or depth))
            raise ConfigError(f"tune.space.{name!r}: unknown key {part!r} in {where}; valid keys: {valid}")
        inner = _section_of(field.annotation)
        prefix = ".".join(parts[: depth + 1])
        if depth < len(parts) - 1:
            if inner is not None:
                model = inner
                continue
            if _is_mapping(field.annotation):
                return  # free-form keyword arguments: the builder they go to judges them
            raise ConfigError(f"tune.space.{name!r}: {prefix} is a value, not a section")
        if inner is not None:
            keys = ", ".join(sorted(inner.model_fields))
            raise ConfigError(f"tune.space.{name!r}: {prefix} is a section; search one of its keys: {keys}")


def set_key(raw: dict[str, Any], name: str, value: Any) -> None:
    """``raw[a][b][c] = value`` for ``name = "a.b.c"`` (missing tables are created)."""
    *path, last = name.split(".")
    node = raw
    for part in path:
        node = node.setdefault(part, {})
    node[last] = value


def order(space: Mapping[str, ParamConfig]) -> list[str]:
    """The parameters in an order where each comes after those its ``when`` names; refuses a
    condition on a parameter the space lacks, and a cycle of conditions."""
    for name, p in space.items():
        for dep in p.when:
            if dep not in space:
                known = ", ".join(space) or "none"
                raise ConfigError(
                    f"tune.space.{name!r}.when: {dep!r} is not a parameter of the space (parameters: "
                    f"{known}); a condition names another [tune.space] entry"
                )
    done: list[str] = []
    pending = list(space)
    while pending:
        ready = [n for n in pending if all(d in done for d in space[n].when)]
        if not ready:
            raise ConfigError(f"tune.space: the 'when' conditions of {', '.join(pending)} form a cycle")
        done += ready
        pending = [n for n in pending if n not in ready]
    return done


def _probes(p: ParamConfig) -> list[Any]:
    if p.type == "categorical":
        return list(p.choices)
    assert p.low is not None and p.high is not None  # checked by ParamConfig
    if p.type == "int":
        return [int(p.low), int(p.high)]
    return [float(p.low), float(p.high)]


def check_space(cfg: Config, base: dict[str, Any]) -> list[str]:
    """Every entry of ``cfg.tune.space`` names a config key that takes its bounds or choices (each
    applied alone to ``base``, the base run's raw config, and validated); returns the suggestion
    order. A study with nothing to search is refused too."""
    space = cfg.tune.space
    if not space:
        raise ConfigError(
            "tune.space: nothing to search; add entries such as "
            '[tune.space."optim.lr"] type = "float", low = 1e-4, high = 0.1, log = true'
        )
    for name in space:
        check_key(name)
    names = order(space)
    for name in names:
        p = space[name]
        for value in _probes(p):
            raw = copy.deepcopy(base)
            set_key(raw, name, value)
            try:
                config_from_dict(raw)
            except ConfigError as err:
                raise ConfigError(f"tune.space.{name!r}: the value {value!r} is rejected: {err}") from None
        for dep, want in p.when.items():
            reachable = _probes(space[dep]) if space[dep].type == "categorical" else None
            if reachable is not None and not any(w in reachable for w in _wanted(want)):
                raise ConfigError(
                    f"tune.space.{name!r}.when: {dep} never takes {want!r} (its choices: {reachable})"
                )
    return names


def active(p: ParamConfig, params: Mapping[str, Any]) -> bool:
    """Whether a conditional parameter applies, given the values suggested before it."""
    return all(dep in params and params[dep] in _wanted(want) for dep, want in p.when.items())


def _wanted(want: Any) -> list[Any]:
    """A ``when`` value: one value, or a list of the values it accepts."""
    return want if isinstance(want, list) else [want]


def suggest(trial: optuna.Trial, space: Mapping[str, ParamConfig], names: list[str]) -> dict[str, Any]:
    """This trial's values, in ``names`` order; a conditional parameter only when its condition holds
    (so samplers see it only where it matters)."""
    params: dict[str, Any] = {}
    for name in names:
        p = space[name]
        if not active(p, params):
            continue
        if p.type == "categorical":
            params[name] = trial.suggest_categorical(name, p.choices)
        elif p.type == "int":
            assert p.low is not None and p.high is not None
            params[name] = trial.suggest_int(name, int(p.low), int(p.high), step=p.step or 1, log=p.log)
        else:
            assert p.low is not None and p.high is not None
            params[name] = trial.suggest_float(name, p.low, p.high, log=p.log)
    return params


def apply(base: dict[str, Any], params: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of the raw config ``base`` with each ``dotted.key = value`` of ``params`` set."""
    raw = copy.deepcopy(base)
    for name, value in params.items():
        set_key(raw, name, value)
    return raw
