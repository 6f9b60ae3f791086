"""One registry for every pluggable family: built-in names resolve, a user's class named by import
string is built and used like a built-in, and every bad string is one config error naming the key."""

from __future__ import annotations

import inspect
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist
from tests._dist import end_group
from tests.conftest import vatra_in_process
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from vatra.comm import Compressor, HookState, Memory, build_compressor
from vatra.comm.plugin import CommPlugin
from vatra.comm.powersgd import PowerSGDHookState
from vatra.config import CommConfig, FederatedConfig, MonitorConfig, StoreConfig, config_from_dict
from vatra.errors import ConfigError
from vatra.federated import FitRes, ParamLayout, Selector, Strategy, build_selector, build_strategy
from vatra.federated.compression import build_upload_hook
from vatra.monitor import Detector, Ensemble
from vatra.registry import FAMILIES
from vatra.resilience import StoreBackend, open_store
from vatra.resilience.erasure import ErasureBackend
from vatra.resilience.fsspec_backend import FsspecBackend
from vatra.resilience.heal import Healer, Policy

# The base class each family's built-ins subclass; models, datasets and losses are callables.
BASES: dict[str, type] = {
    "compressor": Compressor,
    "strategy": Strategy,
    "client selector": Selector,
    "detector": Detector,
    "healing policy": Policy,
    "store backend": StoreBackend,
}
BUILTINS = [(family, name) for family in FAMILIES for name in family.names()]

USER_MODULE = "vatra_test_user_plugins"
USER_CODE = '''
"""A user's plugins, one of every family, as a user would write them beside a config file."""

import numpy as np
import torch

from vatra.comm import Compressor, Ctx
from vatra.federated import Selector, Strategy, weighted_mean
from vatra.monitor import Detector
from vatra.resilience import StoreBackend, StoreError
from vatra.resilience.heal import Action, Policy

NOT_A_CLASS = 3


class FirstShare(Compressor):
    """Sends the leading ceil(ratio * n) elements; lossy, so error feedback carries the rest."""

    summable = True

    def __init__(self, ratio):
        self.ratio = ratio

    @classmethod
    def from_config(cls, cfg):
        return cls(cfg.ratio)

    def compress(self, tensor):
        flat = tensor.reshape(-1)
        keep = max(1, int(np.ceil(flat.numel() * self.ratio)))
        return [flat[:keep].clone()], Ctx(tensor.shape, tensor.dtype)

    def decompress(self, payload, ctx):
        out = torch.zeros(ctx.numel, dtype=ctx.dtype, device=payload[0].device)
        out[: payload[0].numel()] = payload[0]
        return out.view(ctx.shape)


class MeanUpdate(Strategy):
    def aggregate(self, rnd, results, failures):
        self.weights = (self.weights + weighted_mean(results)).astype(np.float32)
        return self.weights


class LowestIds(Selector):
    def select(self, rnd, available, k):
        return sorted(available)[:k]


class AlwaysAlarm(Detector):
    """No ``name``: the ensemble names it by its import string."""

    ready = True

    def score(self, x):
        return 1.0

    def threshold(self):
        return 0.5

    def learn(self, x):
        pass


class Quiet(AlwaysAlarm):
    name = "quiet"

    def score(self, x):
        return 0.0


class CountNorms(Policy):
    """No ``name``; acts (uncapped) on every gradient norm it sees."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.applied = []

    def after_backward(self, trainer, grad_norm):
        return Action(self.name, "counted", f"norm {grad_norm}", capped=False)

    def apply(self, trainer, action):
        self.applied.append(action)


class DictBackend(StoreBackend):
    def __init__(self, url, options=None):
        self.url, self.options, self.data = url, options, {}

    def put(self, key, data):
        self.data[key] = bytes(data)

    def get(self, key):
        if key not in self.data:
            raise StoreError(key)
        return self.data[key]

    def exists(self, key):
        return key in self.data

    def delete(self, key):
        self.data.pop(key, None)

    def keys(self, prefix):
        return sorted(k for k in self.data if k.startswith(prefix))
'''


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The module above on ``sys.path``, plus ``broken_plugins`` that raises on line 3 on import."""
    (tmp_path / f"{USER_MODULE}.py").write_text(USER_CODE)
    (tmp_path / "broken_plugins.py").write_text('"""Broken."""\n\nraise RuntimeError("no GPU here")\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    yield USER_MODULE
    for name in (USER_MODULE, "broken_plugins"):
        sys.modules.pop(name, None)


@pytest.mark.parametrize(("family", "name"), BUILTINS, ids=[f"{f.family}:{n}" for f, n in BUILTINS])
def test_every_builtin_resolves_to_its_kind(family, name: str) -> None:
    # Execute
    obj = family.load(name)

    # Assert
    if (family.family, name) == ("compressor", "powersgd"):
        assert obj is PowerSGDHookState  # a DDP hook state, run by the comm plugin itself
    elif family.family in BASES:
        assert inspect.isclass(obj) and issubclass(obj, BASES[family.family]), obj
    else:
        assert callable(obj), obj
    if family.family in ("detector", "healing policy"):
        assert vars(obj)["name"] == name  # named in its own class body: logs and alarms show it


def test_user_compressor_round_trips_a_tensor(user_module: str) -> None:
    # Prepare
    cfg = CommConfig(method=f"{user_module}:FirstShare", ratio=0.5)
    x = torch.arange(1.0, 11.0).view(2, 5)

    # Execute
    comp = build_compressor(cfg)
    payload, ctx = comp.compress(x)
    y = comp.decompress(payload, ctx)

    # Assert
    assert type(comp).__name__ == "FirstShare" and comp.ratio == 0.5  # from_config saw [comm]
    assert y.shape == x.shape and y.dtype == x.dtype
    assert torch.equal(y.reshape(-1)[:5], x.reshape(-1)[:5])
    assert torch.equal(y.reshape(-1)[5:], torch.zeros(5))


def test_user_compressor_runs_in_the_comm_plugin_with_error_feedback(
    user_module: str, tmp_path: Path
) -> None:
    # Prepare: one gloo rank, a DDP-wrapped linear layer and the trainer attributes the plugin reads
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdzv'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = nn.Linear(8, 4)
        trainer = SimpleNamespace(
            module=DDP(model),
            model=model,
            trainable=model,
            dist=SimpleNamespace(world_size=1, device=torch.device("cpu")),
            state=SimpleNamespace(rank_states={}, step=0, skip_update=False),
            cfg=config_from_dict({"run": {"seed": 0}}),
            log_event=lambda *args, **kwargs: None,
        )
        cfg = CommConfig(method=f"{user_module}:FirstShare", ratio=0.25, min_numel=0, topology="flat")
        plugin = CommPlugin(cfg)
        x = torch.randn(16, 8)

        # Execute
        plugin.on_fit_start(trainer)
        plugin.on_step_start(trainer)
        trainer.module(x).square().sum().backward()
        metrics: dict[str, float] = {}
        plugin.on_step_end(trainer, metrics)

        # Assert: the hook sent a quarter of each tensor and error feedback kept the rest
        assert isinstance(plugin.state, HookState) and type(plugin.state.compressor).__name__ == "FirstShare"
        assert isinstance(plugin.state.memory, Memory) and trainer.state.rank_states["comm"] is plugin
        weight_grad = model.weight.grad.reshape(-1)
        assert torch.count_nonzero(weight_grad[8:]) == 0 and torch.count_nonzero(weight_grad[:8]) == 8
        assert metrics["comm_residual_norm"] > 0.0
        assert set(plugin.state_dict()["residuals"]) == {"weight", "bias"}

        # ... and a step between run.log_every's (10) takes no norm: a pass over every residual
        trainer.state.step = 1
        plugin.on_step_start(trainer)
        trainer.module(x).square().sum().backward()
        between: dict[str, float] = {}
        plugin.on_step_end(trainer, between)
        assert "comm_residual_norm" not in between and "comm_time_s" in between
    finally:
        end_group()


def test_user_strategy_and_selector_are_built_like_builtins(user_module: str) -> None:
    # Prepare
    cfg = FederatedConfig(strategy=f"{user_module}:MeanUpdate", selection=f"{user_module}:LowestIds")
    layout = ParamLayout(("w",), ((3,),))
    results = [
        FitRes(0, 1, num_samples=1, update=np.array([1.0, 0.0, 0.0], dtype=np.float32)),
        FitRes(2, 1, num_samples=3, update=np.array([0.0, 4.0, 0.0], dtype=np.float32)),
    ]

    # Execute
    strategy = build_strategy(cfg, layout)
    selector = build_selector(cfg, seed=7)
    strategy.initialize(np.zeros(3, dtype=np.float32), seed=7)
    picked = selector.select(1, [5, 2, 9, 0], 2)
    ins = strategy.configure_round(1, picked)
    weights = strategy.aggregate(1, results, [])

    # Assert
    assert type(strategy).__name__ == "MeanUpdate" and type(selector).__name__ == "LowestIds"
    assert picked == [0, 2] and sorted(ins) == [0, 2] and selector.seed == 7
    np.testing.assert_allclose(weights, [0.25, 3.0, 0.0])  # sample-weighted: (1·e0 + 3·4e1) / 4


def test_user_detectors_are_built_and_named_by_the_ensemble(user_module: str) -> None:
    # Prepare
    always, quiet = f"{user_module}:AlwaysAlarm", f"{user_module}:Quiet"
    ens = Ensemble(MonitorConfig(detectors=[always, quiet], vote=1, warmup_steps=10, fit_in="thread"))

    # Execute
    during_warmup = [ens.observe(step, 1.0, 1.0) for step in range(1, 11)]
    alarm = ens.observe(11, 1.0, 1.0)
    ens.close()

    # Assert: the one without a name is named by its import string, the other keeps its own
    assert [d.name for d in ens.detectors] == [always, "quiet"]
    assert during_warmup == [None] * 10
    assert alarm is not None and alarm.detectors == [always]
    assert set(alarm.thresholds) == {always, "quiet"}


def test_user_policy_is_built_and_acts_through_the_healer(user_module: str) -> None:
    # Prepare
    value = f"{user_module}:CountNorms"
    healer = Healer(config_from_dict({"heal": {"policies": ["skip_spike", value]}}))
    trainer = SimpleNamespace(
        state=SimpleNamespace(extras={"grad_norm": 2.5}, step=3),
        dist=SimpleNamespace(is_main=False),
        run_dir=None,
    )

    # Execute
    healer.after_backward(trainer)

    # Assert
    user = healer.policies[1]
    assert type(user).__name__ == "CountNorms" and user.name == value
    assert user in healer.deciding_after_backward
    assert [(a.policy, a.kind) for a in user.applied] == [(value, "counted")]
    assert healer.counts == {"counted": 1}


def test_user_store_backend_is_opened_and_stores_versions(user_module: str, tmp_path: Path) -> None:
    # Prepare
    named = StoreConfig(backend=f"{user_module}:DictBackend", url="mem://bucket", options={"region": "x"})
    default = StoreConfig(backend=f"{user_module}:DictBackend")

    # Execute
    store = open_store(named, tmp_path / "unused")
    manifest = store.write_version({"model.pt": b"weights"}, step=4, parent=None, world_size=1)
    restored = store.materialize("latest", tmp_path / "out")
    in_run_folder = open_store(default, tmp_path / "checkpoints")

    # Assert
    assert type(store.backend).__name__ == "DictBackend"
    assert (store.backend.url, store.backend.options) == ("mem://bucket", {"region": "x"})
    assert restored["version"] == manifest["version"]
    assert (tmp_path / "out" / "model.pt").read_bytes() == b"weights"
    assert in_run_folder.backend.url == str((tmp_path / "checkpoints").resolve())
    assert store.backend.describe() == f"{user_module}:DictBackend"


def test_auto_store_backend_is_erasure_with_its_section_else_fsspec(tmp_path: Path) -> None:
    # Prepare
    nodes = [str(tmp_path / f"node{i}") for i in range(3)]
    erasure = StoreConfig(erasure={"k": 2, "m": 3, "nodes": nodes})

    # Execute
    plain = open_store(StoreConfig(), tmp_path / "ckpt").backend
    coded = open_store(erasure, tmp_path / "ckpt").backend
    named = open_store(StoreConfig(backend="erasure", erasure=erasure.erasure), tmp_path / "ckpt").backend

    # Assert
    assert isinstance(plain, FsspecBackend) and plain.url == str((tmp_path / "ckpt").resolve())
    assert isinstance(coded, ErasureBackend) and (coded.k, coded.m) == (2, 3)
    assert isinstance(named, ErasureBackend)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("no_such_module_xyz:Thing", "cannot import module 'no_such_module_xyz'"),
        ("{user}:Nope", "no attribute 'Nope'; it defines: AlwaysAlarm, CountNorms, DictBackend, FirstShare"),
        ("{user}:NOT_A_CLASS", "is the int 3, not a subclass of vatra.comm._base.Compressor"),
        ("{user}:MeanUpdate", "is the class MeanUpdate, not a subclass of vatra.comm._base.Compressor"),
        (
            "broken_plugins:Thing",
            "importing 'broken_plugins' failed: RuntimeError: no GPU here (broken_plugins.py:3)",
        ),
    ],
    ids=["module-not-found", "attribute-missing", "not-a-class", "wrong-base", "raises-on-import"],
)
def test_bad_compressor_strings_name_the_key_and_what_was_found(
    user_module: str, value: str, expected: str
) -> None:
    # Prepare
    cfg = CommConfig(method=value.format(user=user_module))

    # Execute
    with pytest.raises(ConfigError) as err:
        build_compressor(cfg)

    # Assert
    message = str(err.value)
    assert message.startswith("comm.method: ") and expected in message and "\n" not in message


def test_bad_strings_of_other_families_name_their_key(user_module: str, tmp_path: Path) -> None:
    # Prepare
    wrong = f"{user_module}:FirstShare"  # a compressor: the wrong base everywhere else
    layout = ParamLayout(("w",), ((3,),))
    upload = config_from_dict({"federated": {"compression": f"{user_module}:Nope"}})
    calls = {
        "federated.strategy: ": lambda: build_strategy(FederatedConfig(strategy=wrong), layout),
        "federated.selection: ": lambda: build_selector(FederatedConfig(selection=wrong), 0),
        "federated.compression: ": lambda: build_upload_hook(upload, layout),
        "monitor.detectors[1]: ": lambda: Ensemble(
            MonitorConfig(detectors=["zscore", wrong], fit_in="thread")
        ),
        "heal.policies[1]: ": lambda: Healer(config_from_dict({"heal": {"policies": ["rollback", wrong]}})),
        "store.backend: ": lambda: open_store(StoreConfig(backend=wrong), tmp_path),
    }

    for key, call in calls.items():
        # Execute
        with pytest.raises(ConfigError) as err:
            call()

        # Assert
        message = str(err.value)
        assert message.startswith(key) and user_module in message, message


@pytest.mark.parametrize(
    ("raw", "start", "expected"),
    [
        (
            {"comm": {"method": "zigzag"}},
            "comm.method: unknown compressor 'zigzag'",
            "bf16, fp16, int8, none",
        ),
        ({"federated": {"strategy": "fedzig"}}, "federated.strategy: unknown strategy", "fedavg"),
        ({"federated": {"selection": "best"}}, "federated.selection: unknown client selector", "adaptive"),
        ({"federated": {"compression": "powersgd"}}, "federated.compression: powersgd is a DDP hook", "topk"),
        (
            {"monitor": {"detectors": ["zscore", "lof"]}},
            "monitor.detectors.1: unknown detector 'lof'",
            "iforest",
        ),
        ({"heal": {"policies": ["pray"]}}, "heal.policies.0: unknown healing policy 'pray'", "rollback"),
        (
            {"store": {"backend": "tape"}},
            "store.backend: unknown store backend 'tape'",
            "auto, erasure, fsspec",
        ),
        (
            {"store": {"backend": "erasure"}},
            "store: backend = 'erasure' needs a [store.erasure]",
            "k, m, nodes",
        ),
        (
            {"comm": {"method": "pkg.mod"}},
            "comm.method: unknown compressor 'pkg.mod'",
            "'package.module:attribute'",
        ),
    ],
)
def test_config_rejects_malformed_values_in_one_line(raw: dict, start: str, expected: str) -> None:
    # Execute
    with pytest.raises(ConfigError) as err:
        config_from_dict(raw)

    # Assert
    message = str(err.value)
    assert message.startswith(start) and expected in message and "\n" not in message, message


def test_config_accepts_import_strings_without_importing_them() -> None:
    # Execute
    cfg = config_from_dict(
        {
            "comm": {"method": "nosuch.mod:Comp"},
            "federated": {
                "strategy": "nosuch.mod:S",
                "selection": "nosuch.mod:P",
                "compression": "nosuch.mod:C",
            },
            "monitor": {"detectors": ["zscore", "nosuch.mod:D"]},
            "heal": {"policies": ["nosuch.mod:H"]},
            "store": {"backend": "nosuch.mod:B"},
        }
    )

    # Assert
    assert cfg.comm.method == "nosuch.mod:Comp" and cfg.store.backend == "nosuch.mod:B"
    assert cfg.monitor.detectors == ["zscore", "nosuch.mod:D"]
    assert "nosuch" not in sys.modules


def test_cli_reports_a_malformed_value_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Prepare
    toml = tmp_path / "run.toml"
    toml.write_text(textwrap.dedent('[comm]\nmethod = "topk"\n'))

    # Execute: the console entry in this process
    bad_code, _, bad_err = vatra_in_process(
        capsys, "config", "show", str(toml), "--set", "comm.method=zigzag"
    )
    # well-formed: config show imports nothing
    user_code, user_out, user_err = vatra_in_process(
        capsys, "config", "show", str(toml), "--set", "comm.method=nosuch.mod:X"
    )

    # Assert
    lines = bad_err.strip().splitlines()
    assert bad_code == 2, bad_err
    assert len(lines) == 1 and lines[0].startswith("error: comm.method:") and "zigzag" in lines[0]
    assert "Traceback" not in bad_err
    assert user_code == 0, user_err
    assert 'method = "nosuch.mod:X"' in user_out
    assert "nosuch" not in sys.modules


def test_two_configs_with_their_own_model_module_each_build_their_own(tmp_path: Path) -> None:
    # Prepare: two config folders, each with a model.py whose build() says which folder it is
    from vatra.registry import add_import_paths, import_object

    folders = [tmp_path / "first", tmp_path / "second"]
    for folder in folders:
        folder.mkdir()
        (folder / "model.py").write_text(f"def build():\n    return {folder.name!r}\n")
    saved = list(sys.path)
    try:
        # Act: one process loads the first config's model, then the second's (as two vatra.fit calls do)
        built = []
        for folder in folders:
            add_import_paths([folder])
            built.append(import_object("model:build", "model.name")())
        # Assert: the second import string resolved beside the second config, not to the cached first
        assert built == ["first", "second"]
        add_import_paths([folders[0]])  # and back again
        assert import_object("model:build", "model.name")() == "first"
    finally:
        sys.path[:] = saved
        sys.modules.pop("model", None)
