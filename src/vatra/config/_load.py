"""The root config, TOML loading, ``--set`` overrides and one-line error messages."""

from __future__ import annotations

import copy
import tomllib
import typing
from pathlib import Path
from typing import Any, Literal

import tomli_w
from pydantic import ConfigDict, Field, ValidationError, model_validator

from vatra.config._asyncdp import AsyncConfig, DiLoCoConfig, HybridConfig, LocalSGDConfig
from vatra.config._balance import BalanceConfig
from vatra.config._chaos import ChaosConfig
from vatra.config._comm import CommConfig
from vatra.config._edge import EdgeConfig
from vatra.config._energy import EnergyConfig
from vatra.config._federated import FederatedConfig
from vatra.config._live import ResilienceConfig, check_live, check_live_run
from vatra.config._meta import MetaConfig
from vatra.config._modes import check_dist_mode
from vatra.config._monitor import HealConfig, MonitorConfig
from vatra.config._parallel import ParallelConfig
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
from vatra.config._spot import SpotConfig
from vatra.config._tune import TuneConfig
from vatra.errors import ConfigError, VatraError
from vatra.registry import POLICIES, add_import_paths

# Built-in healing policies that act without the monitor: skip_spike reads the engine's gradient
# norm. rollback (loss divergence, the snapshots it returns to, the last-good tags), straggler and
# prefetch act on the monitor's verdicts. A policy named by import string is not judged here.
POLICIES_WITHOUT_MONITOR = ("skip_spike",)


class Config(Section):
    """A whole run: one field per TOML section.

    Checks across sections run here, on the values: with the monitor off, what depends on it is
    refused when the user asked for it (``monitor.report``, a ``[heal]`` that names policies
    acting on the monitor's verdicts) and left out of the resolved config when it was only a
    default, so that config says what runs and reloads unchanged. Keys a kind of run ignores are
    refused when the config is loaded for that kind of run (``run=`` of :func:`load_config`), which
    needs to know what the user wrote.
    """

    model_config = ConfigDict(validate_by_name=True, validate_by_alias=True, serialize_by_alias=True)

    run: RunConfig = Field(default_factory=RunConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    dist: DistConfig = Field(default_factory=DistConfig)
    chaos: ChaosConfig = Field(default_factory=ChaosConfig)
    monitor: MonitorConfig = Field(default_factory=MonitorConfig)
    heal: HealConfig = Field(default_factory=HealConfig)
    energy: EnergyConfig = Field(default_factory=EnergyConfig)
    comm: CommConfig = Field(default_factory=CommConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    store: StoreConfig = Field(default_factory=StoreConfig)
    resilience: ResilienceConfig = Field(default_factory=ResilienceConfig)
    spot: SpotConfig = Field(default_factory=SpotConfig)
    federated: FederatedConfig = Field(default_factory=FederatedConfig)
    tune: TuneConfig = Field(default_factory=TuneConfig)
    balance: BalanceConfig = Field(default_factory=BalanceConfig)
    local_sgd: LocalSGDConfig = Field(default_factory=LocalSGDConfig)
    diloco: DiLoCoConfig = Field(default_factory=DiLoCoConfig)
    hybrid: HybridConfig = Field(default_factory=HybridConfig)
    # `async` is a Python keyword: the field is `async_`, read and written as `async` in TOML.
    async_: AsyncConfig = Field(default_factory=AsyncConfig, alias="async")
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    meta: MetaConfig = Field(default_factory=MetaConfig)
    edge: EdgeConfig = Field(default_factory=EdgeConfig)

    @model_validator(mode="after")
    def _without_monitor(self) -> Config:
        if self.monitor.enabled:
            return self
        if self.monitor.report:
            if "report" in self.monitor.model_fields_set:
                raise ValueError(
                    "monitor.report = true: report.html is part of the monitor, which "
                    "monitor.enabled = false turns off; set monitor.enabled = true or monitor.report = false"
                )
            self.monitor.report = False
        heal = self.heal
        needs = [p for p in heal.policies if POLICIES.is_builtin(p) and p not in POLICIES_WITHOUT_MONITOR]
        if heal.enabled and needs:
            if heal.model_fields_set:  # the user configured healing: do not drop what they asked for
                raise ValueError(
                    f"heal.policies: {', '.join(needs)} act on the monitor's verdicts, which "
                    "monitor.enabled = false turns off; set monitor.enabled = true, heal.enabled = false, "
                    f"or heal.policies = {list(POLICIES_WITHOUT_MONITOR)} (needs no monitor)"
                )
            kept = [p for p in heal.policies if p not in needs]
            if kept:
                heal.policies = kept
            else:
                heal.enabled = False
        return self

    @model_validator(mode="after")
    def _balance_sharding(self) -> Config:
        if self.balance.method != "off" and self.data.sharding in ("dirichlet", "label_skew"):
            raise ValueError(
                f"balance.method = {self.balance.method!r} draws every rank's slice from one global order "
                f"over the training set, so data.sharding = {self.data.sharding!r} (non-IID shards) cannot "
                "hold; set balance.method = 'off' or data.sharding = 'random'"
            )
        if self.balance.adaptive:
            if self.balance.method == "off":
                raise ValueError(
                    "balance.adaptive sizes the per-rank slices of one global batch, so it needs a "
                    "balancer; set balance.method = 'static' (or 'proportional', 'ppo')"
                )
            if self.comm.method != "none" or self.comm.topology in ("ring", "hierarchical"):
                raise ValueError(
                    "balance.adaptive synchronises the gradients itself (so that an out-of-memory rank "
                    "can redo the step with the others), without comm's hooks; set comm.method = 'none' "
                    "and comm.topology = 'auto', or balance.adaptive = false"
                )
        return self

    @model_validator(mode="after")
    def _parallel_layout(self) -> Config:
        """What the mesh can split and what runs beside it; the world size is checked at start."""
        par = self.parallel
        if par.is_default():
            return self
        if par.auto and self.model.name != "gpt":  # auto replaces dp, fsdp, tp and pp at start
            raise ValueError(
                f"parallel.auto: the planner measures the gpt model's blocks, not "
                f"{self.model.name!r}; set parallel.dp, fsdp and tp yourself"
            )
        if par.pp > 1 and par.n_microbatches < par.pp:
            raise ValueError(
                f"parallel.microbatches = {par.n_microbatches} is fewer than parallel.pp = {par.pp} "
                f"stages, so some stages never run at once; set parallel.microbatches ≥ {par.pp} "
                f"(2 × pp = {2 * par.pp} keeps the bubble (p − 1)/(m + p − 1) under 1/3)"
            )
        if par.pp > 1 and self.train.batch_size % par.n_microbatches:
            raise ValueError(
                f"parallel.microbatches = {par.n_microbatches} does not divide train.batch_size = "
                f"{self.train.batch_size}: the pipeline averages equal micro-batches' losses; choose a "
                "batch size that is a multiple of the micro-batch count"
            )
        if par.sequence_parallel and (par.tp == 1 or par.pp > 1 or par.tp_plan):
            raise ValueError(
                "parallel.sequence_parallel splits the built-in gpt plan's norms along the sequence: it "
                "needs parallel.tp > 1, pp = 1 and no parallel.tp_plan (a user's plan names 'sequence' "
                "styles itself)"
            )
        if self.model.name == "gpt":
            heads, layers = self.model.n_head, self.model.n_layer
            if heads % par.tp:
                raise ValueError(
                    f"parallel.tp = {par.tp} does not divide model.n_head = {heads}: tensor parallelism "
                    "gives each rank whole attention heads; choose a tp that divides n_head"
                )
            chunks = par.pp * par.stages_per_rank
            if chunks > layers:
                raise ValueError(
                    f"parallel.pp = {par.pp} with {par.stages_per_rank} stage(s) per rank needs "
                    f"{chunks} blocks, but model.n_layer = {layers}; lower parallel.pp or use a "
                    "schedule with one stage per rank (gpipe, 1f1b)"
                )
        if not par.enabled and not par.auto:
            return self
        if self.dist.mode != "sync":
            raise ValueError(
                f"parallel: fsdp, tp and pp train one model in lockstep over the mesh, but dist.mode = "
                f"{self.dist.mode!r} lets ranks step apart; set dist.mode = 'sync', or "
                "parallel.fsdp = tp = pp = 1"
            )
        if self.comm.method != "none" or self.comm.topology in ("ring", "hierarchical"):
            raise ValueError(
                "parallel: fsdp, tp and pp reduce gradients over the device mesh, without DDP's comm "
                "hooks; set comm.method = 'none' and comm.topology = 'auto', or parallel.fsdp = tp = pp = 1"
            )
        if self.balance.method != "off":
            raise ValueError(
                "parallel: uneven per-rank batches (balance.method) need plain data parallelism; set "
                "balance.method = 'off', or parallel.fsdp = tp = pp = 1"
            )
        if self.train.precision == "fp16":
            raise ValueError(
                "parallel: train.precision = 'fp16' needs a gradient scaler for sharded gradients, "
                "which vatra does not have; use train.precision = 'bf16' or "
                "parallel.fsdp_mixed_precision = 'fp16'"
            )
        if self.train.compile:
            raise ValueError(
                "parallel: train.compile compiles the whole model's forward, which vatra has not tested "
                "on a sharded, split or pipelined model; set train.compile = false, or "
                "parallel.fsdp = tp = pp = 1"
            )
        return self

    @model_validator(mode="after")
    def _live(self) -> Config:
        check_live(self)
        return self

    @model_validator(mode="after")
    def _meta(self) -> Config:
        if not self.meta.enabled:
            return self
        if self.dist.mode != "sync" or not self.parallel.is_default() or self.balance.method != "off":
            raise ValueError(
                "meta: a meta-step gathers every task's meta-gradient across the ranks itself, so it "
                "needs plain data parallelism; set dist.mode = 'sync', balance.method = 'off' and no "
                "[parallel] layout"
            )
        if self.train.grad_accum != 1:
            raise ValueError(
                "meta: meta.tasks_per_step sets a meta-step's batch of episodes; set train.grad_accum = 1"
            )
        if self.comm.method != "none":
            raise ValueError(
                f"meta: the meta-step gathers every task's meta-gradient uncompressed, so comm.method = "
                f"{self.comm.method!r} would not apply; set comm.method = 'none'"
            )
        return self

    @model_validator(mode="after")
    def _dist_mode(self) -> Config:
        check_dist_mode(self)
        return self


RunKind = Literal["train", "federated", "meta"]
_FEDERATED_CHECKPOINT = {"keep_last"}  # the [checkpoint] keys a federated server reads


def _refuse_ignored_keys(cfg: Config, run: RunKind, said: dict[str, Any]) -> None:
    """Refuse the keys in ``said`` (what the user wrote: raw TOML and overrides) that a ``run`` of
    this kind ignores, naming them. A key written with its default value is ignored just the same,
    so "written" counts, not "differs from the default"."""

    def written(section: str) -> list[str]:
        table = said.get(section)
        return sorted(table) if isinstance(table, dict) else []

    check_live_run(cfg, run)
    if written("tune"):
        raise ConfigError(
            f"{', '.join(f'tune.{k}' for k in written('tune'))}: a {run} run reads no [tune] keys (they "
            "describe a study over runs); run 'vatra tune CONFIG', or remove the [tune] section"
        )
    if written("meta") and (run == "federated" or (run == "train" and not cfg.meta.enabled)):
        raise ConfigError(
            f"{', '.join(f'meta.{k}' for k in written('meta'))}: a {run} run reads no [meta] keys (they "
            "describe meta-learning); run 'vatra meta CONFIG', or remove the [meta] section"
        )
    if run == "federated":
        ignored = [f"checkpoint.{key}" for key in written("checkpoint") if key not in _FEDERATED_CHECKPOINT]
        if ignored:
            raise ConfigError(
                f"{', '.join(ignored)}: a federated run reads no [checkpoint] keys but keep_last (the "
                "server saves its whole state as a version of the [store] after every round and always "
                "resumes from the newest); remove them"
            )
        if written("spot"):
            raise ConfigError(
                f"{', '.join(f'spot.{k}' for k in written('spot'))}: a federated run reads no [spot] keys "
                "(preemption notices stop a training run); remove the [spot] section"
            )
        if written("parallel"):
            raise ConfigError(
                f"{', '.join(f'parallel.{k}' for k in written('parallel'))}: a federated run reads no "
                "[parallel] keys (each client trains its whole model in one process); remove the "
                "[parallel] section"
            )
        if written("balance"):
            raise ConfigError(
                f"{', '.join(f'balance.{k}' for k in written('balance'))}: a federated run reads no "
                "[balance] keys (each client trains its own data at its own pace); remove the [balance] "
                "section"
            )
    elif cfg.comm.method == "powersgd" and "min_numel" in written("comm"):
        raise ConfigError(
            "comm.min_numel: powersgd ignores it (PowerSGD sends vectors, and matrices a "
            "rank-r factorisation would not shrink by 2×, uncompressed); remove comm.min_numel"
        )


def _is_resolved(raw: dict[str, Any]) -> bool:
    """Whether a file already lists every key with its resolved value (a run folder's
    ``config.toml``, the output of ``vatra config show``): such a file says nothing about which
    keys its user meant to set, so only overrides given on top of it count for
    :func:`_refuse_ignored_keys`."""
    try:
        return tomllib.loads(dump_toml(Config.model_validate(copy.deepcopy(raw)))) == raw
    except (ValidationError, VatraError):
        return False


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


def _field(model: type[Section], key: str) -> Any:
    """The field a TOML key names: by name, or by alias (``async`` is the field ``async_``)."""
    found = model.model_fields.get(key)
    return found or next((f for f in model.model_fields.values() if f.alias == key), None)


_KINDS = {"bool": ["true", "false"], "int": ["an integer"], "float": ["a number"], "str": ["a string"]}


def _union_error(errors: list[Any]) -> str | None:
    """A value that fits none of a key's types (``bool | 'auto'``): pydantic reports one error per
    type, at the key's path plus the type's tag; said as one line naming every accepted form."""
    tags = [e["loc"][-1] for e in errors if e["loc"]]
    if len(errors) < 2 or len(tags) != len(errors) or len({tuple(e["loc"][:-1]) for e in errors}) != 1:
        return None
    forms: list[str] = []
    for tag in tags:
        if not isinstance(tag, str) or not (tag in _KINDS or tag.startswith("literal[")):
            return None
        forms += _KINDS.get(tag) or tag.removeprefix("literal[").removesuffix("]").split(",")
    forms = [f.strip() for f in forms]
    said = ", ".join(forms[:-1]) + f" or {forms[-1]}"
    loc = ".".join(str(p) for p in errors[0]["loc"][:-1])
    return f"{loc}: expected {said} (got {errors[0].get('input')!r})"


def _format_error(err: ValidationError) -> str:
    """One line: dotted path, what was wrong, what is allowed."""
    union = _union_error(err.errors())
    if union is not None:
        return union
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first["loc"])
    if first["type"] == "extra_forbidden":
        model: type[Section] = Config
        parts = iter(first["loc"][:-1])
        for part in parts:
            field = _field(model, str(part))
            if field is None:
                break
            annotation = field.annotation
            if typing.get_origin(annotation) is dict:  # a table of named sections ([tune.space."k"])
                annotation = typing.get_args(annotation)[1]
                if next(parts, None) is None:
                    break
            if not isinstance(annotation, type):
                break
            model = annotation
        allowed = ", ".join(sorted(f.alias or name for name, f in model.model_fields.items()))
        msg = f"{loc}: unknown key; allowed keys here: {allowed}"
    elif not loc:  # a check across sections: its message names the keys
        msg = first["msg"].removeprefix("Value error, ")
    elif first["type"] == "finite_number":
        msg = (
            f"{loc}: must be a finite number (got {first.get('input')!r}); no config key takes NaN "
            "or ±inf: where a key can be off, its description says which number means off (often 0)"
        )
    else:
        text = first["msg"].removeprefix("Value error, ").removeprefix("Assertion failed, ")
        given = first.get("input")  # a whole section (a check across its keys) names its keys itself
        msg = f"{loc}: {text}" if isinstance(given, dict) else f"{loc}: {text} (got {given!r})"
    more = len(err.errors()) - 1
    return msg + (f" [+{more} more]" if more else "")


def config_from_dict(
    raw: dict[str, Any], base_dir: str | Path | None = None, run: RunKind | None = None
) -> Config:
    """Validate a raw config; ``run.import_paths`` are read from ``base_dir`` (a config file's folder,
    which is also their default). With ``run``, keys in ``raw`` that such a run ignores are refused.

    The import paths go on ``sys.path`` here, so import strings in the config resolve in this
    process and in every worker that loads the resolved config from the run folder.
    """
    if base_dir is not None:
        section = raw.setdefault("run", {})
        if isinstance(section, dict):
            base = Path(base_dir).resolve()
            given = section.get("import_paths", ["."])  # default: the config file's own folder
            if isinstance(given, list) and all(isinstance(p, str) and "\0" not in p for p in given):
                section["import_paths"] = list(dict.fromkeys(str((base / p).resolve()) for p in given))
    try:
        cfg = Config.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_format_error(err)) from None
    if run is not None:
        _refuse_ignored_keys(cfg, run, raw)
    add_import_paths(cfg.run.import_paths)
    return cfg


def load_config(
    path: str | Path | None, overrides: list[str] | None = None, run: RunKind | None = None
) -> Config:
    """Load a TOML file (or only defaults when ``path`` is None) and apply overrides.

    With ``run`` (the CLI's ``vatra train``, ``vatra federate``, ...), keys the file or the
    overrides set that such a run ignores are refused. Workers that reload a run folder's resolved
    config pass none.
    """
    raw: dict[str, Any] = {}
    said: dict[str, Any] = {}  # what the user wrote, for the ignored-keys check
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p} (pass a TOML file such as examples/digits.toml)")
        data = p.read_bytes()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as err:
            line = data.count(b"\n", 0, err.start) + 1
            raise ConfigError(
                f"{p}: not UTF-8 text (byte {err.start}, line {line}: {data[err.start]:#04x}); "
                "TOML files are UTF-8: save it as UTF-8"
            ) from None
        try:
            raw = tomllib.loads(text)
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"{p}: invalid TOML: {err}") from None
        if run is not None and not _is_resolved(raw):
            said = copy.deepcopy(raw)
        _absolute_data_path(raw, p.parent)  # a path written in the file is read from the file's folder
    raw = apply_overrides(raw, overrides or [])
    _absolute_data_path(raw, Path.cwd())  # one given with --set, from the working directory
    cfg = config_from_dict(raw, Path(path).parent if path is not None else None)
    if run is not None:
        _refuse_ignored_keys(cfg, run, apply_overrides(said, overrides or []))
    return cfg


def _absolute_data_path(raw: dict[str, Any], base: Path) -> None:
    """Make relative local paths (``data.path``, ``federated.partition.file``, ``balance.policy``,
    ``energy.intensity_csv``) absolute against ``base`` (URLs such as s3:// stay)."""
    fed = raw.get("federated")
    part = fed.get("partition") if isinstance(fed, dict) else None
    for section, key in (
        (raw.get("data"), "path"),
        (part, "file"),
        (raw.get("balance"), "policy"),
        (raw.get("energy"), "intensity_csv"),
    ):
        if isinstance(section, dict) and isinstance(section.get(key), str) and section[key]:
            given = section[key]
            if "://" not in given and not Path(given).is_absolute():
                section[key] = str(base.resolve() / given)


def dump_toml(cfg: Config) -> str:
    """The resolved config as TOML (None values are left out: TOML has no null). ``[tune]`` only
    when it describes a study and ``[meta]`` only when it is set, so a plain run's resolved config
    has neither and reloads as that run."""
    return tomli_w.dumps(cfg.model_dump(mode="json", exclude_none=True, exclude=_no_study(cfg)))


def _no_study(cfg: Config) -> set[str]:
    # sections that describe another kind of run, left out while they hold only defaults
    return {name for name in ("tune", "meta") if getattr(cfg, name).is_default()}
