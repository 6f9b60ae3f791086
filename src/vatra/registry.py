"""One registry for every pluggable family: a built-in name and a user's import string work alike.

A config key that names a model, dataset, loss, compressor, strategy, selector, detector, healing
policy or store backend takes either a built-in name (``"mlp"``) or an import string
(``"package.module:attribute"``). Built-ins are themselves import strings, kept here by name, so
checking a name needs no import (the config layer validates at load time) and resolving one
imports only the module it names.

Every failure is a :class:`~vatra.errors.ConfigError` (one ``error:`` line, exit code 2) that names
the config key and what was found: module not found, attribute missing, not callable, not the
expected class, wrong return type.
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from vatra.errors import ConfigError

_DOTTED = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
IMPORT_FORM = "an import string 'package.module:attribute'"


def is_import_string(value: str) -> bool:
    """``"pkg.mod:attr"`` (attribute may be dotted: ``"pkg.mod:Class.method"``)."""
    module, sep, attr = value.partition(":")
    return bool(sep) and bool(_DOTTED.match(module)) and bool(_DOTTED.match(attr))


def add_import_paths(paths: Iterable[str | Path]) -> None:
    """Put folders first on ``sys.path`` (once each), so modules beside a config file import.

    A module already imported from another folder under a name one of these folders defines (two
    configs, each with its own ``model.py``, run in one process) is forgotten, so the next import
    takes this folder's: otherwise the second config would silently build the first one's model."""
    for p in reversed([str(Path(p)) for p in paths]):
        if p in sys.path:
            sys.path.remove(p)
        sys.path.insert(0, p)
        _forget_shadowed(Path(p))


def _forget_shadowed(folder: Path) -> None:
    try:
        entries = list(folder.iterdir())
    except OSError:
        return
    names = {e.stem for e in entries if e.suffix == ".py"} | {
        e.name for e in entries if (e / "__init__.py").is_file()
    }
    root = folder.resolve()
    for name in names & sys.modules.keys():
        origin = getattr(sys.modules[name], "__file__", None)
        if origin is not None and Path(origin).resolve().is_relative_to(root):
            continue
        for sub in [n for n in sys.modules if n == name or n.startswith(name + ".")]:
            del sys.modules[sub]


def _user_frame(err: BaseException) -> str:
    """``file:line`` of the innermost frame outside the import machinery, for import failures."""
    frames = [f for f in traceback.extract_tb(err.__traceback__) if "importlib" not in f.filename]
    return f" ({Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""


def import_object(spec: str, key: str) -> Any:
    """The object an import string names; a one-line :class:`ConfigError` naming ``key`` otherwise."""
    if not is_import_string(spec):
        raise ConfigError(f"{key}: {spec!r} is not {IMPORT_FORM}")
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        missing = err.name or ""
        if module_name == missing or module_name.startswith(missing + "."):
            raise ConfigError(
                f"{key}: cannot import module {module_name!r} for {spec!r} (no module named {missing!r}); "
                "put it beside the config file, list its folder in run.import_paths, or install it"
            ) from None
        raise ConfigError(f"{key}: importing {module_name!r} failed: {err}{_user_frame(err)}") from None
    except Exception as err:  # the user's module raised while importing
        raise ConfigError(
            f"{key}: importing {module_name!r} failed: {type(err).__name__}: {err}{_user_frame(err)}"
        ) from None
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            public = _defined_in(obj)
            shown = ", ".join(public[:12]) + (", ..." if len(public) > 12 else "")
            raise ConfigError(
                f"{key}: {module_name!r} has no attribute {attr!r}"
                + (f"; it defines: {shown}" if shown else "")
            )
        obj = getattr(obj, part)
    return obj


def _defined_in(obj: Any) -> list[str]:
    """Public names an object defines itself (for a module: not what it imported), sorted."""
    if not hasattr(obj, "__dict__"):
        return []
    names = {n: v for n, v in vars(obj).items() if not n.startswith("_")}
    own = [n for n, v in names.items() if getattr(v, "__module__", None) == getattr(obj, "__name__", None)]
    return sorted(own or names)


def describe(obj: Any) -> str:
    """A short phrase for error messages: ``a list``, ``the int 3``, ``the class Foo``."""
    if inspect.isclass(obj):
        return f"the class {obj.__qualname__}"
    if isinstance(obj, int | float | str | bool):
        return f"the {type(obj).__name__} {obj!r}"
    name = type(obj).__name__
    return f"an {name}" if name[:1].lower() in "aeiou" else f"a {name}"


def accepts(fn: Callable[..., Any], name: str) -> bool:
    """Whether ``fn`` takes a keyword argument ``name`` (declared, or through ``**kwargs``)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # builtins without a signature
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def call_with(fn: Callable[..., Any], kwargs: dict[str, Any], optional: dict[str, Any], key: str) -> Any:
    """``fn(**kwargs, **the optional ones fn accepts)``; a bad keyword is a config error naming ``key``."""
    extra = {k: v for k, v in optional.items() if k not in kwargs and accepts(fn, k)}
    try:
        inspect.signature(fn).bind(**kwargs, **extra)
    except TypeError as err:
        raise ConfigError(
            f"{key}: cannot call {getattr(fn, '__qualname__', fn)!r} with these arguments: {err}"
        ) from None
    except ValueError:  # no signature to check against
        pass
    return fn(**kwargs, **extra)


class Registry:
    """Built-in names of one family (each an import string) plus users' import strings.

    ``check`` validates a value without importing anything (config load time); ``load`` resolves it;
    ``load_callable`` / ``load_class`` add the type check the family needs.
    """

    def __init__(self, family: str, key: str, builtins: dict[str, str]) -> None:
        self.family = family  # "model", "dataset", ...
        self.key = key  # the config key that usually names one: "model.name"
        self.builtins = dict(builtins)

    def names(self) -> list[str]:
        return sorted(self.builtins)

    def is_builtin(self, value: str) -> bool:
        return value in self.builtins

    def choices(self) -> str:
        return f"{', '.join(self.names())}, or {IMPORT_FORM}"

    def check(self, value: str) -> str:
        """Pydantic validator: a built-in name or a well-formed import string (nothing imported)."""
        if value in self.builtins or is_import_string(value):
            return value
        raise ValueError(f"unknown {self.family} {value!r}; choose one of: {self.choices()}")

    def load(self, value: str, key: str | None = None) -> Any:
        key = key or self.key
        if value in self.builtins:
            return import_object(self.builtins[value], key)
        if not is_import_string(value):
            raise ConfigError(f"{key}: unknown {self.family} {value!r}; choose one of: {self.choices()}")
        return import_object(value, key)

    def load_callable(self, value: str, key: str | None = None) -> Callable[..., Any]:
        obj = self.load(value, key)
        if not callable(obj):
            raise ConfigError(f"{key or self.key}: {value!r} is {describe(obj)}, not a callable")
        return obj

    def load_class(self, value: str, base: type, key: str | None = None) -> type:
        obj = self.load(value, key)
        if not (inspect.isclass(obj) and issubclass(obj, base)):
            raise ConfigError(
                f"{key or self.key}: {value!r} is {describe(obj)}, not a subclass of "
                f"{base.__module__}.{base.__qualname__}"
            )
        return obj


def check_returned(obj: Any, expected: type | tuple[type, ...], value: str, key: str, what: str) -> Any:
    """``obj`` when it is an ``expected`` instance; else a config error: what ``value`` returned."""
    if not isinstance(obj, expected):
        raise ConfigError(f"{key}: {value!r} returned {describe(obj)}; expected {what}")
    return obj


MODELS = Registry(
    "model",
    "model.name",
    {
        "cnn": "vatra.models.cnn:build_cnn",
        "gpt": "vatra.models.gpt:build_gpt",
        "mlp": "vatra.models.mlp:build_mlp",
    },
)
DATASETS = Registry(
    "dataset",
    "data.name",
    {
        "delta": "vatra.data.tables.source:build_delta",
        "digits": "vatra.data.datasets:digits",
        "images": "vatra.data.images:build_images",
        "npz": "vatra.data.npz:build_npz",
        "synthetic": "vatra.data.datasets:synthetic",
        "table": "vatra.data.tabular:build_table",
        "text": "vatra.data.datasets:text",
    },
)
LOSSES = Registry(
    "loss",
    "train.loss",
    {
        "bce": "vatra.losses.classification:BCE",
        "cross_entropy": "vatra.losses.classification:CrossEntropy",
        "huber": "vatra.losses.regression:Huber",
        "listnet": "vatra.losses.ranking:ListNet",
        "mse": "vatra.losses.regression:MSE",
        "multitask": "vatra.losses.multitask:MultiTask",
    },
)
# "none" and "powersgd" are not per-tensor compressors: the comm plugin handles them itself.
COMPRESSORS = Registry(
    "compressor",
    "comm.method",
    {
        "bf16": "vatra.comm.bf16:BF16",
        "fp16": "vatra.comm.fp16:FP16",
        "int8": "vatra.comm.int8:Int8",
        "none": "vatra.comm.none:NoCompression",
        "onebit": "vatra.comm.onebit:OneBit",
        "powersgd": "vatra.comm.powersgd:PowerSGDHookState",
        "qsgd": "vatra.comm.qsgd:QSGD",
        "randomk": "vatra.comm.randomk:RandomK",
        "topk": "vatra.comm.topk:TopK",
    },
)
STRATEGIES = Registry(
    "strategy",
    "federated.strategy",
    {
        "clustered": "vatra.federated.clustered:Clustered",
        "fedadam": "vatra.federated.fedadam:FedAdam",
        "fedavg": "vatra.federated.fedavg:FedAvg",
        "fedprox": "vatra.federated.fedprox:FedProx",
        "fedyogi": "vatra.federated.fedyogi:FedYogi",
        "krum": "vatra.federated.robust:Krum",
        "median": "vatra.federated.robust:Median",
        "perfedavg": "vatra.federated.perfedavg:PerFedAvg",
        "personalized": "vatra.federated.personalized:Personalized",
        "trimmed_mean": "vatra.federated.robust:TrimmedMean",
    },
)
SELECTORS = Registry(
    "client selector",
    "federated.selection",
    {
        "adaptive": "vatra.federated.adaptive:AdaptiveSelector",
        "all": "vatra.federated.selection:AllSelector",
        "random": "vatra.federated.selection:RandomSelector",
    },
)
DETECTORS = Registry(
    "detector",
    "monitor.detectors",
    {
        "autoencoder": "vatra.monitor.autoencoder:AutoencoderDetector",
        "iforest": "vatra.monitor.iforest:IsolationForestDetector",
        "zscore": "vatra.monitor.zscore:ZScoreDetector",
    },
)
POLICIES = Registry(
    "healing policy",
    "heal.policies",
    {
        "prefetch": "vatra.resilience.heal.prefetch:Prefetch",
        "rollback": "vatra.resilience.heal.rollback:Rollback",
        "skip_spike": "vatra.resilience.heal.skip_spike:SkipSpike",
        "straggler": "vatra.resilience.heal.straggler:Straggler",
    },
)
STORE_BACKENDS = Registry(
    "store backend",
    "store.backend",
    {
        "erasure": "vatra.resilience.erasure:ErasureBackend",
        "fsspec": "vatra.resilience.fsspec_backend:FsspecBackend",
    },
)

FAMILIES: tuple[Registry, ...] = (
    MODELS,
    DATASETS,
    LOSSES,
    COMPRESSORS,
    STRATEGIES,
    SELECTORS,
    DETECTORS,
    POLICIES,
    STORE_BACKENDS,
)
