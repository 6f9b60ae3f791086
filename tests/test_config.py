"""Config: TOML loading, typed overrides, one-line errors and the show round-trip."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from vatra.config import Config, config_from_dict, dump_toml, load_config, parse_override
from vatra.errors import ConfigError

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.toml"))


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
            "data.name: unknown dataset 'imagenet'; choose one of: digits, images, npz, synthetic, table, "
            "text, or an import string",
        ),
        ("data.sharding=bogus", "data.sharding: Input should be 'random'"),
        ("train.steps=0", "train.steps: Input should be greater than or equal to 1"),
        ("trainsteps", "expected section.key=value"),
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
