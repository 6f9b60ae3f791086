"""Config: TOML loading, typed overrides, one-line errors and the show round-trip."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from vatra.config import Config, config_from_dict, dump_toml, load_config, parse_override
from vatra.errors import ConfigError

# Training configs; spot_seed.toml is the spot simulator's own format (tests/test_spot_sim.py).
EXAMPLES = sorted(
    p for p in (Path(__file__).resolve().parents[1] / "examples").glob("*.toml") if p.name != "spot_seed.toml"
)


def test_overrides_are_typed() -> None:
    assert parse_override("train.steps=60") == (["train", "steps"], 60)
    assert parse_override("optim.lr=3e-4") == (["optim", "lr"], 3e-4)
    assert parse_override("model.hidden=[64, 32]") == (["model", "hidden"], [64, 32])
    assert parse_override("data.name=digits") == (["data", "name"], "digits")
    assert parse_override('run.name="a b"') == (["run", "name"], "a b")


def test_overrides_apply_over_file(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[train]\nsteps = 10\n[data]\nname = "synthetic"\n')
    cfg = load_config(path, ["train.steps=60", "optim.schedule=cosine"])
    assert cfg.train.steps == 60
    assert cfg.data.name == "synthetic"
    assert cfg.optim.schedule == "cosine"
    assert cfg.train.batch_size == 32  # default filled in


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("data.foo=1", "data.foo: unknown key; allowed keys here:"),
        ("nosuch.key=1", "nosuch: unknown key; allowed keys here: "),
        ("train.steps=abc", "train.steps: Input should be a valid integer"),
        (
            "data.name=imagenet",
            "data.name: unknown dataset 'imagenet'; choose one of: delta, digits, images, npz, synthetic, "
            "table, text, or an import string",
        ),
        ("data.sharding=bogus", "data.sharding: Input should be 'random'"),
        ("train.steps=0", "train.steps: Input should be greater than or equal to 1"),
        ("trainsteps", "expected section.key=value"),
        ("data.prefetch=-1", "data.prefetch: Input should be greater than or equal to 0 (got -1)"),
        ("edge.qat=int4", "edge.qat: Input should be 'none', 'int8' or 'int4w' (got 'int4')"),
        ("comm.ratio=0", "comm.ratio must be 'auto' or a share in (0, 1], got 0.0"),
        ("comm.adam1bit=maybe", "comm.adam1bit: Input should be a valid boolean"),
        ("monitor.profile_steps=5:2", "monitor.profile_steps: steps '5:2': expected A:B with 1 ≤ A ≤ B"),
        ("dist.ps_wire=none", "dist.ps_wire: 'none' is not a per-tensor compressor; use fp32"),
        # a key of two types (bool | 'auto'): one line naming every form it takes, not one per type
        ("comm.overlap=sometimes", "comm.overlap: expected true, false or 'auto' (got 'sometimes')"),
        ("comm.ratio=lots", "comm.ratio: expected a number or 'auto' (got 'lots')"),
        (
            "comm.warmup_precision=int4",
            "comm.warmup_precision: Input should be 'fp4', 'fp8' or 'fp16' (got 'int4')",
        ),
    ],
)
def test_bad_values_fail_with_one_line(override: str, expected: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    message = str(err.value)
    assert expected in message
    assert "\n" not in message


def test_missing_file_and_bad_toml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nsteps = 1")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(bad)


def test_cross_field_validation() -> None:
    with pytest.raises(ConfigError, match="divisible by n_head"):
        config_from_dict({"model": {"n_embd": 30, "n_head": 4}})


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_show_round_trip(path: Path, tmp_path: Path) -> None:
    cfg = load_config(path, ["train.steps=7"])
    text = dump_toml(cfg)
    again = Config.model_validate(tomllib.loads(text))
    assert again == cfg
    resolved = tmp_path / "resolved.toml"
    resolved.write_text(text)
    assert load_config(resolved) == cfg


@pytest.mark.parametrize(
    "override",
    [
        "optim.lr=inf",
        "optim.lr=nan",
        "train.clip_grad_norm=inf",
        "train.class_weights=[1.0, -inf]",
        "federated.privacy.target_epsilon=inf",
        "checkpoint.mtbf_s=inf",
    ],
)
def test_non_finite_numbers_are_refused_everywhere(override: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    key = override.partition("=")[0]
    assert str(err.value).startswith(f"{key}") and "must be a finite number" in str(err.value)
    assert "\n" not in str(err.value)


def test_a_non_finite_number_in_a_file_names_its_key(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("[optim]\nlr = inf\n")
    with pytest.raises(ConfigError, match=r"^optim\.lr: must be a finite number \(got inf\)"):
        load_config(path)
    load_config(None, ["model.kwargs={limit = inf}"])  # a user factory's own arguments pass unchecked


@pytest.mark.parametrize("name", ["../x", "/abs", "a/b", "a\\b", ""])
def test_a_run_name_cannot_leave_the_out_dir(name: str) -> None:
    with pytest.raises(ConfigError, match=r"^run\.name: the name (contains|is empty).*run\.out_dir"):
        config_from_dict({"run": {"name": name}})


def test_run_names_that_stay_inside_are_kept() -> None:
    for name in ("..", "digits.small", "a b", "..x"):
        assert config_from_dict({"run": {"name": name}}).run.name == name


def test_a_config_that_is_not_utf8_is_one_line_naming_the_file_and_byte(tmp_path: Path) -> None:
    path = tmp_path / "latin1.toml"
    path.write_bytes('[run]\nname = "café"\n'.encode("latin-1"))
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == (
        f"{path}: not UTF-8 text (byte 17, line 2: 0xe9); TOML files are UTF-8: save it as UTF-8"
    )


def test_what_needs_the_monitor_is_refused_when_asked_for_without_it() -> None:
    off = {"monitor": {"enabled": False}}
    with pytest.raises(ConfigError, match=r"^monitor\.report = true: .* set monitor\.enabled = true or"):
        config_from_dict({"monitor": {"enabled": False, "report": True}})
    for heal in ({"enabled": True}, {"lr_backoff": 0.3}, {"policies": ["skip_spike", "straggler"]}):
        with pytest.raises(ConfigError) as err:
            config_from_dict({**off, "heal": heal})
        assert str(err.value).startswith("heal.policies: ")
        assert "act on the monitor's verdicts" in str(err.value)
        assert "heal.policies = ['skip_spike'] (needs no monitor)" in str(err.value)
    assert config_from_dict({**off, "heal": {"enabled": False}}).heal.enabled is False
    assert config_from_dict({**off, "heal": {"policies": ["skip_spike"]}}).heal.policies == ["skip_spike"]


def test_without_the_monitor_its_defaults_resolve_to_what_runs() -> None:
    cfg = config_from_dict({"monitor": {"enabled": False}})
    assert cfg.monitor.report is False
    assert cfg.heal.enabled and cfg.heal.policies == ["skip_spike"]  # the one that needs no monitor
    again = Config.model_validate(tomllib.loads(dump_toml(cfg)))  # a worker reloads config.toml
    assert again == cfg
    with_monitor = config_from_dict({})
    assert with_monitor.monitor.report and with_monitor.heal.policies == [
        "skip_spike",
        "rollback",
        "straggler",
        "prefetch",
    ]


def test_a_federated_run_refuses_the_checkpoint_keys_it_ignores_and_reads_store(tmp_path: Path) -> None:
    sets = ["checkpoint.async=true", "store.url='/tmp/x'", "checkpoint.every_steps=25"]  # 25: the default
    with pytest.raises(ConfigError) as err:
        load_config(None, sets, run="federated")
    assert str(err.value) == (
        "checkpoint.async, checkpoint.every_steps: a federated run reads no [checkpoint] keys but "
        "keep_last (the server saves its whole state as a version of the [store] after every round and "
        "always resumes from the newest); remove them"
    )
    load_config(None, sets, run="train")  # training reads them
    load_config(None, sets)  # a worker reloading a run folder's config checks nothing
    path = tmp_path / "fl.toml"
    path.write_text("[federated]\nrounds = 3\n[checkpoint]\n")  # an empty table sets nothing
    load_config(path, run="federated")
    # the server's rounds are versions of the store: [store] and checkpoint.keep_last apply
    erasure = {"k": 1, "m": 2, "nodes": ["a", "b"]}
    cfg = config_from_dict({"store": {"erasure": erasure}, "checkpoint": {"keep_last": 2}}, run="federated")
    assert cfg.store.erasure is not None and cfg.checkpoint.keep_last == 2
    assert load_config(None, ["store.url='/tmp/x'"], run="federated").store.url == "/tmp/x"


def test_a_resolved_config_is_not_taken_for_what_its_user_set(tmp_path: Path) -> None:
    # A run folder's config.toml (or `vatra config show` output) lists every key: used as a config
    # again, only the overrides on top of it say what the user set.
    path = tmp_path / "resolved.toml"
    path.write_text(dump_toml(load_config(None, ["federated.rounds=3"])))
    assert load_config(path, run="federated").federated.rounds == 3
    with pytest.raises(ConfigError, match=r"^checkpoint\.every_steps: a federated run"):
        load_config(path, ["checkpoint.every_steps=2"], run="federated")
    assert load_config(path, ["checkpoint.keep_last=2"], run="federated").checkpoint.keep_last == 2
    edited = tmp_path / "edited.toml"  # one key removed: no longer a resolved config
    edited.write_text(path.read_text().replace("keep_last = 5\n", ""))
    with pytest.raises(ConfigError, match=r"^checkpoint\.async, checkpoint\.enabled, .*: a federated run"):
        load_config(edited, run="federated")


def test_powersgd_refuses_min_numel() -> None:
    with pytest.raises(ConfigError, match=r"^comm\.min_numel: powersgd ignores it"):
        load_config(None, ["comm.method=powersgd", "comm.min_numel=1024"], run="train")
    load_config(None, ["comm.method=powersgd"], run="train")
    load_config(None, ["comm.method=topk", "comm.min_numel=16"], run="train")
    # federated.compression reads comm.min_numel; comm.method is not what a federated run uses
    load_config(None, ["comm.method=powersgd", "comm.min_numel=16"], run="federated")


def test_powersgd_from_a_file_without_min_numel_is_accepted(tmp_path: Path) -> None:
    """A config file (run.import_paths resolved from its folder) asking only for PowerSGD: nothing
    the user wrote is ignored, so nothing is refused, from a file as from a resolved run folder."""
    path = tmp_path / "pg.toml"
    path.write_text('[comm]\nmethod = "powersgd"\n')
    assert load_config(path, run="train").comm.method == "powersgd"
    resolved = tmp_path / "config.toml"
    resolved.write_text(dump_toml(load_config(path)))
    assert load_config(resolved, run="train").comm.method == "powersgd"
