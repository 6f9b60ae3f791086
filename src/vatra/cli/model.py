"""``vatra model``: register trained runs as immutable versions, list, show and diff them, and move
aliases (``champion``, ``challenger``) forward and back with an append-only history."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.console import Console
from rich.table import Table

from vatra.cli.app import app
from vatra.errors import ConfigError

if TYPE_CHECKING:
    from vatra.serve.registry import ModelVersion, Registry

model_app = typer.Typer(
    rich_markup_mode=None,
    help="A registry of model versions with lineage, aliases and rollback.",
    no_args_is_help=True,
)
app.add_typer(model_app, name="model")

REGISTRY = typer.Option(
    None,
    "--registry",
    help="Where the registry lives: a folder or s3://bucket/prefix (default: $VATRA_REGISTRY, else models).",
)
KEY_ENV = typer.Option(
    None,
    "--hmac-key-env",
    help="Name of the environment variable holding the key that signs and checks every record "
    "(default: $VATRA_REGISTRY_HMAC_KEY_ENV; unset = unsigned).",
)
REF = typer.Argument(..., help="NAME@alias, NAME@<id prefix> or NAME (its newest version).")


def open_registry(uri: str | None, key_env: str | None) -> Registry:
    from vatra.serve.registry import Registry, key_from_env

    return Registry(uri, hmac_key=key_from_env(key_env))


def _when(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.UTC).strftime("%Y-%m-%d %H:%M:%S")


def _metrics(mv: ModelVersion, limit: int = 3) -> str:
    items = sorted(mv.meta.get("metrics", {}).items())[:limit]
    return ", ".join(f"{k}={v:.4g}" for k, v in items) or "-"


def _data(mv: ModelVersion) -> str:
    data = mv.meta.get("data") or {}
    if data.get("table"):
        return f"{data['table']}@v{data.get('version')}"
    return str(data.get("name") or "-")


def parse_evidence(text: str | None) -> dict[str, Any] | None:
    """``--evidence``: a JSON object, or ``@file.json``."""
    if not text:
        return None
    source = "--evidence"
    if text.startswith("@"):
        source = text[1:]
        try:
            text = Path(source).read_text()
        except OSError as err:
            raise ConfigError(f"--evidence {source}: cannot be read ({err.strerror or err})") from None
    try:
        value = json.loads(text)
    except ValueError as err:
        raise ConfigError(f"{source}: not JSON ({err}); pass a JSON object or @file.json") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{source}: must be a JSON object, such as '{{\"p_value\": 0.01}}'")
    return value


@model_app.command("register")
def model_register(
    run_dir: Path = typer.Argument(
        ..., help="Run folder (runs/<run-id>), or a model folder (vatra export, vatra meta adapt --save)."
    ),
    name: str = typer.Option(..., "--name", help="The model's name in the registry, such as churn."),
    fmt: str = typer.Option(
        "safetensors",
        "--format",
        help="Export format of a run: safetensors, torchscript or onnx (a model folder keeps its own).",
    ),
    registry: str | None = REGISTRY,
    key_env: str | None = KEY_ENV,
) -> None:
    """Export a run's model, or take a model folder as it is, and store it as an immutable version
    (the same run or folder registers as the same id)."""
    from vatra.serve.registry.lineage import MODEL_MANIFEST, register_folder, register_run

    reg = open_registry(registry, key_env)
    before = {v.id for v in reg.versions(name)} if name in reg.names() else set()
    if (run_dir / MODEL_MANIFEST).is_file():
        mv = register_folder(reg, run_dir, name)
    else:
        mv = register_run(reg, run_dir, name, fmt)
    state = "already registered" if mv.id in before else "registered"
    print(f"{state} {mv.ref} (id {mv.id}) in {reg.uri}")
    print(f"  parent {mv.parent[:12] if mv.parent else '-'}; data {_data(mv)}; metrics {_metrics(mv)}")


@model_app.command("list")
def model_list(
    name: str | None = typer.Argument(None, help="A model's name: list its versions (default: every model)."),
    registry: str | None = REGISTRY,
    key_env: str | None = KEY_ENV,
) -> None:
    """Models in the registry, or one model's versions oldest first with their aliases."""
    reg = open_registry(registry, key_env)
    console = Console(width=160)
    if name is None:
        if not reg.names():
            print(f"no models in {reg.uri}; add one with 'vatra model register RUN --name NAME'")
            return
        table = Table("model", "versions", "newest", "registered (UTC)", "aliases")
        for model in reg.names():
            versions = reg.versions(model)
            named = ", ".join(f"{a}={v[:12]}" for a, v in sorted(reg.aliases(model).items()))
            table.add_row(
                model, str(len(versions)), versions[-1].short, _when(versions[-1].time), named or "-"
            )
        console.print(table)
        return
    reg.get(name)  # an unknown name: one line naming the models there are
    aliases: dict[str, list[str]] = {}
    for alias, version in reg.aliases(name).items():
        aliases.setdefault(version, []).append(alias)
    table = Table("version", "registered (UTC)", "by", "parent", "data", "metrics", "MB", "aliases")
    for mv in reg.versions(name):
        table.add_row(
            mv.short,
            _when(mv.time),
            mv.user,
            mv.parent[:12] if mv.parent else "-",
            _data(mv),
            _metrics(mv),
            f"{mv.size / 1e6:.2f}",
            ",".join(sorted(aliases.get(mv.id, []))) or "-",
        )
    console.print(table)


@model_app.command("show")
def model_show(
    ref: str = REF,
    as_json: bool = typer.Option(False, "--json", help="Print the whole version record as JSON."),
    registry: str | None = REGISTRY,
    key_env: str | None = KEY_ENV,
) -> None:
    """One version: id, parent, who registered it, lineage, metrics, signature, files and aliases."""
    reg = open_registry(registry, key_env)
    mv = reg.get(ref)
    if as_json:
        print(json.dumps(mv.record(), indent=1, sort_keys=True))
        return
    meta = mv.meta
    aliases = sorted(a for a, v in reg.aliases(mv.name).items() if v == mv.id)
    print(f"{mv.name}@{mv.short}  id {mv.id}")
    print(f"parent:       {mv.parent or '-'}")
    print(f"registered:   {_when(mv.time)} UTC by {mv.user or '-'}")
    print(f"aliases:      {', '.join(aliases) or '-'}")
    print(f"run:          {meta.get('run') or '-'}")
    print(f"data:         {_data(mv)}")
    print(f"code version: {meta.get('code_version') or '-'}")
    print(f"format:       {meta.get('format') or '-'}")
    for key, value in sorted(meta.get("metrics", {}).items()):
        print(f"metric:       {key} = {value}")
    signature = meta.get("signature") or {}
    if signature:
        print(f"signature:    {json.dumps(signature, sort_keys=True)[:400]}")
    for path, entry in sorted(mv.files.items()):
        print(f"file:         {path}  {entry['size']} B  sha256 {entry['sha256'][:12]}")


@model_app.command("diff")
def model_diff(
    first: str = typer.Argument(..., help="A version: NAME@alias or NAME@<id prefix>."),
    second: str = typer.Argument(..., help="The version to compare it with."),
    registry: str | None = REGISTRY,
    key_env: str | None = KEY_ENV,
) -> None:
    """What differs between two versions: config keys, metrics, data version, signature, code and files."""
    from vatra.serve.registry.diff import diff_versions

    reg = open_registry(registry, key_env)
    a, b = reg.get(first), reg.get(second)
    rows = diff_versions(a, b)
    if not rows:
        print(f"{a.ref} and {b.ref} are the same version" if a.id == b.id else "no differences in lineage")
        return
    table = Table("section", "key", a.ref, b.ref)
    for section, key, va, vb in rows:
        table.add_row(section, key, str(va), str(vb))
    Console(width=160).print(table)


@model_app.command("promote")
def model_promote(
    ref: str = typer.Argument(..., help="The version to promote: NAME@<id prefix> or NAME@<another alias>."),
    alias: str = typer.Option(..., "--alias", help="The alias to move, such as champion or challenger."),
    reason: str = typer.Option(..., "--reason", help="Why, for the alias history."),
    evidence: str | None = typer.Option(
        None, "--evidence", help="A JSON object (or @file.json) recorded with it."
    ),
    registry: str | None = REGISTRY,
    key_env: str | None = KEY_ENV,
) -> None:
    """Point an alias at a version; the move is appended to the alias's history."""
    reg = open_registry(registry, key_env)
    found = reg.get(ref)
    move = reg.promote(found.name, found.id, alias, reason, parse_evidence(evidence))
    print(
        f"{found.name}@{alias}: {move.source[:12] if move.source else '-'} -> {move.target[:12]} ({reason})"
    )


@model_app.command("rollback")
def model_rollback(
    name: str = typer.Argument(..., help="The model's name."),
    alias: str = typer.Option("champion", "--alias", help="The alias to move one step back."),
    reason: str = typer.Option("rollback", "--reason", help="Why, for the alias history."),
    registry: str | None = REGISTRY,
    key_env: str | None = KEY_ENV,
) -> None:
    """Move an alias back to the version it named before its last promote (appended to its history)."""
    reg = open_registry(registry, key_env)
    move = reg.rollback(name, alias, reason)
    print(f"{name}@{alias}: {move.source[:12] if move.source else '-'} -> {move.target[:12]} ({reason})")


@model_app.command("history")
def model_history(
    name: str = typer.Argument(..., help="The model's name."),
    registry: str | None = REGISTRY,
    key_env: str | None = KEY_ENV,
) -> None:
    """Every alias move of a model, oldest first: when, who, which alias, from and to, and why."""
    reg = open_registry(registry, key_env)
    table = Table("when (UTC)", "by", "alias", "action", "from", "to", "reason", "evidence")
    for m in reg.history(name):
        table.add_row(
            _when(m.time),
            m.user,
            m.alias,
            m.action,
            m.source[:12] if m.source else "-",
            m.target[:12],
            m.reason,
            json.dumps(m.evidence, sort_keys=True)[:60] if m.evidence else "-",
        )
    Console(width=160).print(table)


TRACKING = typer.Option(
    ..., "--tracking-uri", help="The MLflow tracking and registry URI, such as sqlite:///mlflow.db."
)


@model_app.command("export-mlflow")
def model_export_mlflow(
    ref: str = REF,
    tracking_uri: str = TRACKING,
    mlflow_name: str | None = typer.Option(
        None, "--mlflow-name", help="Registered model name (default: NAME)."
    ),
    experiment: str = typer.Option("vatra-registry", "--experiment", help="MLflow experiment of the run."),
    registry: str | None = REGISTRY,
    key_env: str | None = KEY_ENV,
) -> None:
    """Copy a version into an MLflow model registry, with vatra's lineage as tags and its aliases."""
    from vatra.serve.registry.mlflow_io import export_version

    out = export_version(
        open_registry(registry, key_env), ref, tracking_uri, mlflow_name=mlflow_name, experiment=experiment
    )
    aliases = f"; aliases {', '.join(out.aliases)}" if out.aliases else ""
    print(f"MLflow model {out.name} version {out.version} (run {out.run_id}){aliases}")


@model_app.command("import-mlflow")
def model_import_mlflow(
    source: str = typer.Argument(..., help="MLflow model version: MODEL/VERSION or MODEL@alias."),
    tracking_uri: str = TRACKING,
    name: str | None = typer.Option(
        None, "--name", help="Name in the vatra registry (default: the MLflow name)."
    ),
    aliases: bool = typer.Option(
        True, "--aliases/--no-aliases", help="Promote its MLflow aliases in vatra too."
    ),
    registry: str | None = REGISTRY,
    key_env: str | None = KEY_ENV,
) -> None:
    """Register an MLflow model version in vatra (a version exported from vatra keeps its id)."""
    from vatra.serve.registry.mlflow_io import import_version

    mv, moved = import_version(
        open_registry(registry, key_env), source, tracking_uri, name=name, aliases=aliases
    )
    print(f"registered {mv.ref} (id {mv.id})" + (f"; aliases {', '.join(moved)}" if moved else ""))
