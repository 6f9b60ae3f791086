"""Owners agree on their data before they train together: the federation's data contract, and
``data.categories`` pinning a column's categories for ``vatra train`` and for federation."""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
import pytest
from tests.conftest import small_config

from vatra.config import Config
from vatra.data import build_dataset
from vatra.data.tabular.split import random_val
from vatra.errors import ConfigError
from vatra.federated.certs import generate
from vatra.federated.contract import MAX_BYTES, DataContract, contract_of, pins_problem
from vatra.federated.data import ClientData, build_federation, data_context, load_source, own_data
from vatra.federated.grpc.agree import agree


def _csv(path: Path, sexes: list[str], *, s6: bool = True, rows: int = 40) -> Path:
    """A diabetes-like table: age, bmi, s6 (optional), sex as text, and a 0/1 target."""
    rng = np.random.default_rng(len(sexes) + rows)
    head = ["age", "bmi", *(["s6"] if s6 else []), "sex", "y"]
    lines = [",".join(head)]
    for i in range(rows):
        x = rng.normal(size=3)
        cells = [f"{x[0]:.4f}", f"{x[1]:.4f}", *([f"{x[2]:.4f}"] if s6 else []), sexes[i % len(sexes)]]
        lines.append(",".join([*cells, str(int(x[0] + x[1] > 0))]))
    path.write_text("\n".join(lines) + "\n")
    return path


def _cfg(**data: object) -> Config:
    return small_config(
        data={"name": "table", "target": "y", "categorical": ["sex"], "val_fraction": 0.25, **data},
        federated={"clients": 2, "rounds": 1, "min_clients": 1, "heartbeat_s": 0.5, "heartbeat_misses": 2},
        monitor={"report": False},
    )


def _owner(cfg: Config, path: Path) -> ClientData:
    return own_data(load_source(cfg, str(path), "--data"), "--data")


def _agree(cfg: Config, path: Path, federation: DataContract | None, said: list[str]) -> ClientData:
    return agree(cfg, _owner(cfg, path), federation, lambda pinned: _owner(pinned, path), said.append)


def _server_contract(cfg: Config, path: Path) -> DataContract:
    contract = contract_of(_owner(cfg, path).train)
    assert contract is not None
    return contract


# ------------------------------------------------------------------- the contract, in process
def test_mismatched_categories_are_refused_naming_the_column_and_the_values(tmp_path: Path) -> None:
    # Prepare: the server's file codes sex F/M, this clinic F/female
    cfg = _cfg()
    federation = _server_contract(cfg, _csv(tmp_path / "held.csv", ["F", "M"]))
    # Execute / Assert
    with pytest.raises(ConfigError) as err:
        _agree(cfg, _csv(tmp_path / "clinic.csv", ["F", "female"]), federation, [])
    line = str(err.value)
    assert "\n" not in line
    assert "column 'sex': this owner has categories ['F', 'female'], the federation's are ['F', 'M']" in line
    assert "map 'female' to one of them or pin data.categories" in line


def test_only_the_order_differs_conforms_and_the_one_hot_columns_agree(tmp_path: Path) -> None:
    # Prepare: the server pins sex = M, F; the clinic's own config pins nothing (sorted: F, M)
    server_cfg = _cfg(categories={"sex": ["M", "F"]})
    held = _csv(tmp_path / "held.csv", ["F", "M"])
    federation = _server_contract(server_cfg, held)
    assert federation.categories == {"sex": ["M", "F"]}
    clinic = _csv(tmp_path / "clinic.csv", ["M", "F", "F"])
    plain = _owner(_cfg(), clinic)
    assert plain.spec.feature_names[-2:] == ("sex=F", "sex=M")  # what it would have trained on
    # Execute
    said: list[str] = []
    conformed = _agree(_cfg(), clinic, federation, said)
    # Assert: the same columns as the server's, and each row's one-hot bit is its own sex's
    server = _owner(server_cfg, held)
    assert conformed.spec.feature_names == server.spec.feature_names
    assert contract_of(conformed.train) == federation
    names = list(conformed.spec.feature_names)
    for data, path in ((conformed, clinic), (server, held)):
        x = data.train.fields["x"].numpy()  # (N, F + 2)
        sexes = np.array([line.split(",")[3] for line in path.read_text().splitlines()[1:]])
        train_sex = sexes[~random_val(len(sexes), 0.25, _cfg().run.seed)]  # the seeded split's train rows
        np.testing.assert_array_equal(x[:, names.index("sex=M")], (train_sex == "M").astype(np.float32))
        np.testing.assert_array_equal(x[:, names.index("sex=F")], (train_sex == "F").astype(np.float32))
    # the clinic's rows are the same rows, only its one-hot columns swapped
    x_plain, x_conf = plain.train.fields["x"].numpy(), conformed.train.fields["x"].numpy()
    np.testing.assert_array_equal(x_plain[:, :-2], x_conf[:, :-2])
    np.testing.assert_array_equal(x_plain[:, -2:], x_conf[:, -2:][:, ::-1])
    assert said == ["encoded its data in the federation's columns and categories"]


def test_a_missing_column_is_named(tmp_path: Path) -> None:
    cfg = _cfg()
    federation = _server_contract(cfg, _csv(tmp_path / "held.csv", ["F", "M"]))
    with pytest.raises(
        ConfigError, match=r"column 's6': the federation's data has it, this owner's does not"
    ):
        _agree(cfg, _csv(tmp_path / "clinic.csv", ["F", "M"], s6=False), federation, [])


def test_one_category_only_is_named_and_encoded_as_the_federations(tmp_path: Path) -> None:
    cfg = _cfg()
    held = _csv(tmp_path / "held.csv", ["F", "M"])
    federation = _server_contract(cfg, held)
    said: list[str] = []
    conformed = _agree(cfg, _csv(tmp_path / "women.csv", ["F"]), federation, said)
    assert said[0] == "column 'sex': this owner holds one category only ('F') of the federation's ['F', 'M']"
    assert conformed.spec.input_shape == _owner(cfg, held).spec.input_shape == (5,)  # not (4,) vs (5,)
    # the first owner to publish, with one category and no pin, is told to pin it
    said.clear()
    _agree(cfg, _csv(tmp_path / "women.csv", ["F"]), None, said)
    assert said == [
        "column 'sex': this owner holds one category only ('F') and sets the federation's categories: "
        "pin data.categories.sex so that owners with others can join"
    ]


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ("not an object", "is an object of"),
        ({"numeric": "age", "categories": {}, "target": ["y"], "classes": {}, "encoding": "onehot"}, "list"),
        (
            {"numeric": [1], "categories": {}, "target": ["y"], "classes": {}, "encoding": "onehot"},
            "not a name",
        ),
        (
            {
                "numeric": ["a"],
                "categories": {"a": ["x"]},
                "target": ["y"],
                "classes": {},
                "encoding": "onehot",
            },
            "twice",
        ),
        (
            {"numeric": [], "categories": {}, "target": ["y"], "classes": {"z": [0]}, "encoding": "onehot"},
            "no target",
        ),
        ({"numeric": [], "categories": {}, "target": ["y"], "classes": {}, "encoding": "pickle"}, "encoding"),
        (
            {
                "numeric": ["c" * 200] * 2000,
                "categories": {},
                "target": [],
                "classes": {},
                "encoding": "onehot",
            },
            "KiB",
        ),
    ],
)
def test_a_hostile_contract_is_refused_before_use(raw: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DataContract.from_json(raw)
    assert MAX_BYTES < 1024 * 1024  # fits the smallest message a server accepts before it knows the model


# ------------------------------------------------------------------- data.categories
def test_data_categories_pins_the_order_for_vatra_train_and_names_a_value_outside(tmp_path: Path) -> None:
    path = _csv(tmp_path / "d.csv", ["F", "M"])
    cfg = _cfg(path=str(path), categorical=[], categories={"sex": ["M", "F"], "y": [1, 0]})
    train, _, spec = build_dataset(cfg.data, data_context(cfg))
    assert spec.feature_names == ("age", "bmi", "s6", "sex=M", "sex=F")  # pinned, not sorted
    assert train.preprocess.classes == {"y": [1, 0]}  # type: ignore[union-attr]
    bad = _csv(tmp_path / "bad.csv", ["F", "M", "F", "female"])
    cfg = _cfg(path=str(bad), categories={"sex": ["M", "F"]})
    with pytest.raises(ConfigError) as err:
        build_dataset(cfg.data, data_context(cfg))
    assert str(err.value).startswith(
        "data.categories: column 'sex' holds 'female' in row 4 of bad.csv (line 5), outside its categories "
        "['M', 'F'] (9 more cell(s) too)"
    )


def test_data_categories_pins_the_order_for_a_federation(tmp_path: Path) -> None:
    # simulation: every owner's rows are encoded with the pinned order
    path = _csv(tmp_path / "all.csv", ["F", "M"], rows=60)
    cfg = _cfg(path=str(path), categories={"sex": ["M", "F"]})
    assert build_federation(cfg).spec.feature_names[-2:] == ("sex=M", "sex=F")
    # deployment: a first joiner whose categories disagree with the server's pins is refused
    first = _server_contract(_cfg(), path)
    assert (
        pins_problem(cfg, first) == "column 'sex': its categories are ['F', 'M'], the server pins ['M', 'F']"
    )
    assert pins_problem(cfg, _server_contract(cfg, path)) is None


# ------------------------------------------------------------------- over gRPC, end to end
def test_owners_agree_over_grpc_or_are_refused_in_one_line(tmp_path: Path) -> None:
    from tests._fl_helpers import start_client, start_server

    from vatra.rundir import read_jsonl

    # Prepare: the server holds F/M rows and pins sex = M, F; the clinics' config pins nothing
    generate(tmp_path / "certs", 2)
    held = _csv(tmp_path / "held.csv", ["F", "M"])
    server_cfg = _cfg(categories={"sex": ["M", "F"]}, val_fraction=0.2)
    server, address = start_server(server_cfg, tmp_path / "certs", tmp_path / "run", eval_data=str(held))
    cfg = _cfg()
    # Execute: a clinic coding sex as F/female, then one whose F/M sort the other way round
    bad = start_client(
        cfg, address, 1, tmp_path / "certs", data=str(_csv(tmp_path / "c1.csv", ["F", "female"]))
    )
    with pytest.raises(ConfigError, match=r"column 'sex': this owner has categories \['F', 'female'\]"):
        bad.join_result(30)
    good = start_client(cfg, address, 0, tmp_path / "certs", data=str(_csv(tmp_path / "c0.csv", ["M", "F"])))
    # Assert: the good one trained with the server's column order; the bad one never joined
    assert good.join_result(60) == 1
    assert server.join_result(30)["rounds"] == 1
    events = read_jsonl(tmp_path / "run" / "events.jsonl")
    assert [e["client"] for e in events if e["event"] == "joined"] == [0]
    assert not [e for e in events if e["event"] == "join_refused"]  # refused at home, before joining


# ------------------------------------------------------------------- the server's side, attacked
def test_the_hub_adopts_the_first_contract_and_refuses_a_hostile_or_different_one(tmp_path: Path) -> None:
    import grpc
    from tests.test_fl_hub_attacks import _Aborted, _Context, _hub

    from vatra.federated.data import spec_to_json
    from vatra.federated.wire import decode, encode

    # Prepare: a server without data; two owners' joins
    cfg = _cfg()
    hub = _hub(tmp_path, small_config(federated={"clients": 3}, monitor={"report": False}), spec=None)
    first = _owner(cfg, _csv(tmp_path / "a.csv", ["F", "M"]))
    other = _owner(cfg, _csv(tmp_path / "b.csv", ["F", "female"]))

    def join(cid: int, data: ClientData, contract: object) -> _Context:
        ctx = _Context(cid)
        body = {"kind": "join", "spec": spec_to_json(data.spec), "num_train": data.num_train}
        with contextlib.suppress(_Aborted):
            hub.join(encode({**body, "contract": contract}), ctx)
        return ctx

    # Execute / Assert: nothing published yet
    assert decode(hub.data_contract(b"", _Context(0)))[0]["contract"] is None
    # a hostile contract is refused before anything is adopted
    hostile = {
        "numeric": [{"$ref": 1}],
        "categories": {},
        "target": ["y"],
        "classes": {},
        "encoding": "onehot",
    }
    ctx = join(2, first, hostile)
    assert ctx.code == grpc.StatusCode.INVALID_ARGUMENT and "not a name" in ctx.details
    assert hub.contract is None and hub.spec is None
    # the first good join publishes its contract
    mine = contract_of(first.train)
    assert mine is not None
    assert join(0, first, mine.to_json()).code is None
    assert DataContract.from_json(decode(hub.data_contract(b"", _Context(1)))[0]["contract"]) == mine
    # a joiner that did not conform is refused, the column and values named
    theirs = contract_of(other.train)
    assert theirs is not None
    ctx = join(1, other, theirs.to_json())
    assert ctx.code == grpc.StatusCode.FAILED_PRECONDITION
    assert (
        "column 'sex': this owner has categories ['F', 'female'], the federation's are ['F', 'M']"
        in ctx.details
    )
    # and so is one that sends no contract at all
    assert join(1, first, None).code == grpc.StatusCode.FAILED_PRECONDITION


def test_vatra_train_stops_before_its_workers_on_a_value_outside_the_pins(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.conftest import vatra_in_process

    _csv(tmp_path / "d.csv", ["F", "M", "female"])
    (tmp_path / "t.toml").write_text(
        '[data]\nname = "table"\npath = "d.csv"\ntarget = "y"\ncategories = { sex = ["F", "M"] }\n'
    )
    code, _, err = vatra_in_process(
        capsys, "train", str(tmp_path / "t.toml"), "--run-dir", str(tmp_path / "run")
    )
    assert code == 2
    assert err.strip() == (
        "error: data.categories: column 'sex' holds 'female' in row 3 of d.csv (line 4), outside its "
        "categories ['F', 'M'] (12 more cell(s) too); map it to one of them or add it to data.categories.sex"
    )
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("labels", [["benign", "malignant"], ["false", "true"], ["0", "1"]])
def test_an_owner_missing_a_class_trains_on_the_federations_classes(
    tmp_path: Path, labels: list[str]
) -> None:
    # Prepare: a site whose rows hold one diagnosis only (text, boolean or integer labels)
    def table(path: Path, values: list[str]) -> Path:
        rows = [f"{i / 10},{'FM'[i % 2]},{values[i % len(values)]}" for i in range(20)]
        path.write_text("age,sex,y\n" + "\n".join(rows) + "\n")
        return path

    cfg = _cfg()
    federation = _server_contract(cfg, table(tmp_path / "held.csv", labels))
    # Execute
    site = _agree(cfg, table(tmp_path / "site.csv", labels[:1]), federation, [])
    # Assert: two classes, in the federation's order, class ids as the server's
    assert contract_of(site.train) == federation
    assert site.spec.num_classes == 2
    assert set(site.train.fields["y"].tolist()) == {0}


def test_an_owner_that_read_no_contract_before_another_published_one_conforms_to_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import time

    from tests._fl_helpers import start_client, start_server

    import vatra.federated.grpc.client as grpc_client
    from vatra.rundir import read_jsonl

    # Prepare: a server with no data; owner 0 publishes sex = F, M; owner 1 (women only) read the
    # contract before that (owners starting together), so it joins with its own sex = F
    generate(tmp_path / "certs", 2)
    cfg = _cfg(val_fraction=0.2)
    cfg = cfg.model_copy(update={"federated": cfg.federated.model_copy(update={"min_clients": 2})})
    real, stale = grpc_client.fetch_contract, [1]

    def fetch(target: str, ca: bytes, client_id: int, token: str, retry_s: float) -> DataContract | None:
        if client_id == 1 and stale:  # its first read: before owner 0 joined
            stale.pop()
            return None
        return real(target, ca, client_id, token, retry_s)

    monkeypatch.setattr(grpc_client, "fetch_contract", fetch)
    server, address = start_server(cfg, tmp_path / "certs", tmp_path / "run")
    first = start_client(cfg, address, 0, tmp_path / "certs", data=str(_csv(tmp_path / "c0.csv", ["F", "M"])))
    events = tmp_path / "run" / "events.jsonl"
    deadline = time.monotonic() + 30
    while not (events.exists() and any(e["event"] == "data_contract" for e in read_jsonl(events))):
        assert time.monotonic() < deadline, "owner 0 published no contract"
        time.sleep(0.05)
    # Execute
    second = start_client(cfg, address, 1, tmp_path / "certs", data=str(_csv(tmp_path / "c1.csv", ["F"])))
    # Assert: refused once (its categories in another extent), then it read the contract and trained
    assert second.join_result(60) == first.join_result(60) == 1
    assert server.join_result(30)["rounds"] == 1
    logged = read_jsonl(events)
    assert [e["client"] for e in logged if e["event"] == "join_refused"] == [1]
    assert sorted(e["client"] for e in logged if e["event"] == "joined") == [0, 1]


@pytest.mark.parametrize(
    ("pins", "message"),
    [
        ({"sex": []}, "categories.sex is empty"),
        ({"sex": ["F", "M", "F"]}, r"categories.sex lists \['F'\] more"),
    ],
)
def test_bad_pins_are_refused_when_the_config_loads(pins: dict[str, list[str]], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _cfg(categories=pins)
