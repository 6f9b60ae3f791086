"""``vatra model ab-report NAME``: the always-valid A/B test on a serving log folder, printed as a
table with the decision, optionally written as an HTML page and applied to the registry's aliases."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.table import Table

from vatra._html import fmt
from vatra.cli.model import KEY_ENV, REGISTRY, model_app, open_registry
from vatra.errors import ConfigError, write_failed
from vatra.serve.ab import ABConfig, ABResult, Evidence, analyse, read_log, render

if TYPE_CHECKING:
    from vatra.serve.registry import Registry


def _print(result: ABResult, console: Console) -> None:
    arms = Table(title=f"{result.challenger} (challenger) vs {result.champion} (champion)")
    arms.add_column("")
    cols: list[Evidence] = []
    if result.decision.evidence is not None and result.decision.rule in ("win", "lose", "futility"):
        arms.add_column("at decision")
        cols.append(result.decision.evidence)
    if result.primary is not None:
        arms.add_column("now")
        cols.append(result.primary)
    rows: list[tuple[str, Callable[[Evidence], object]]] = [
        (f"n {result.champion}", lambda e: e.n_champion),
        (f"n {result.challenger}", lambda e: e.n_challenger),
        (f"mean {result.champion}", lambda e: e.mean_champion),
        (f"mean {result.challenger}", lambda e: e.mean_challenger),
        ("effect", lambda e: e.effect),
        ("interval", lambda e: f"[{fmt(e.lo)}, {fmt(e.hi)}]"),
        ("always-valid p", lambda e: e.p),
    ]
    for label, get in rows:
        arms.add_row(label, *(fmt(get(e)) for e in cols))
    console.print(arms)
    guards = Table(title="guardrails")
    for col in ("guardrail", "champion", "challenger", "interval", "p", "status"):
        guards.add_column(col)
    for g in result.guardrails:
        gev = g.tripped or g.now
        guards.add_row(
            g.name,
            fmt(g.champion),
            fmt(g.challenger),
            f"[{fmt(gev.lo)}, {fmt(gev.hi)}]" if gev else "-",
            fmt(gev.p) if gev else "-",
            f"TRIPPED at n={g.tripped.n_champion}+{g.tripped.n_challenger}" if g.tripped else "ok",
        )
    console.print(guards)
    split = ", ".join(f"{k}={v}" for k, v in result.traffic.items())
    console.print(f"traffic: {split}", markup=False, highlight=False)
    for note in result.notes:
        console.print(f"note: {note}", markup=False, highlight=False)
    for why, n in sorted(result.skipped.items()):
        console.print(f"skipped {n} lines ({why})", markup=False, highlight=False)
    d = result.decision
    console.print(f"decision: {d.action} ({d.rule}): {d.reason}", markup=False, highlight=False)


def _same(a: str | None, b: str) -> bool:
    """Two version ids, either possibly a prefix of the other (the log may hold a short id)."""
    return a is not None and (a.startswith(b) or b.startswith(a))


def apply_decision(registry: Registry, name: str, result: ABResult) -> str | None:
    """Record the decision in the registry's alias history, with its evidence; returns what was
    done, or None for ``continue``.

    ``promote`` moves the champion alias to the challenger's version. ``rollback`` (a guardrail
    tripped, or the challenger lost) and ``stop`` (futility) roll the challenger alias back one
    step, so the challenger stops taking this traffic; when its history has no earlier version,
    the challenger alias is pointed at the champion's version instead. Idempotent: once the alias
    no longer says what the log says (already applied, or moved by hand), nothing is moved, so a
    scheduled ``ab-report --apply`` does not roll back step after step."""
    from vatra.serve.registry import RegistryUsageError

    d = result.decision
    if d.action == "continue":
        return None
    evidence = result.evidence_dict()
    champ, chall = result.champion, result.challenger
    champ_v, chall_v = result.latest[champ], result.latest[chall]
    current = registry.aliases(name)
    if d.action == "promote":
        if _same(current.get(champ), chall_v):
            return f"already applied: {name}@{champ} is {chall_v}"
        registry.promote(name, chall_v, champ, d.reason, evidence=evidence)
        return f"promoted {name}@{chall_v} to alias {champ}"
    if not _same(current.get(chall), chall_v):
        return f"already applied: {name}@{chall} no longer serves {chall_v}"
    try:
        move = registry.rollback(name, chall, d.reason, evidence=evidence)
    except RegistryUsageError:  # never promoted before this version: fall back to the champion's
        why = f"{d.reason}; no earlier {chall} version, so it now serves the champion's"
        move = registry.promote(name, champ_v, chall, why, evidence=evidence)
    return f"moved alias {chall} of {name} from {chall_v} back to {move.target}"


@model_app.command("ab-report")
def ab_report(
    name: Annotated[str, typer.Argument(help="The served model's name.")],
    log_dir: Annotated[
        Path | None, typer.Option("--log-dir", help="The serving log folder; default runs/serve/NAME.")
    ] = None,
    metric: Annotated[str, typer.Option(help="binary (outcome values 0/1) or continuous.")] = "binary",
    alpha: Annotated[float, typer.Option(help="Error rate of each sequential test.")] = 0.05,
    mde: Annotated[
        float | None,
        typer.Option(help="Minimum effect of interest (metric units); set it to stop for futility."),
    ] = None,
    horizon: Annotated[
        int, typer.Option(help="Outcomes expected in all; the interval is tightest there.")
    ] = 5000,
    champion: Annotated[str, typer.Option(help="The champion's variant name in the log.")] = "champion",
    challenger: Annotated[
        str | None, typer.Option(help="The challenger's variant name (default: the one other variant).")
    ] = None,
    lower_is_better: Annotated[
        bool, typer.Option("--lower-is-better", help="A lower metric is better (e.g. time to answer).")
    ] = False,
    latency_ms: Annotated[
        float | None,
        typer.Option(help="Latency guardrail line in ms (default: the champion's early p95)."),
    ] = None,
    html: Annotated[
        Path | None, typer.Option("--html", help="Write the report as one HTML page here.")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the decision and evidence as JSON.")] = False,
    apply: Annotated[
        bool, typer.Option("--apply", help="Record the decision in the registry's alias history.")
    ] = False,
    registry: str | None = REGISTRY,
    key_env: str | None = KEY_ENV,
) -> None:
    """Judge an A/B test from the serving logs with an always-valid sequential test (mSPRT).

    Reads predictions.jsonl and outcomes.jsonl, joins each outcome to its variant, and prints the
    effect (challenger - champion), its confidence sequence, the always-valid p-value, the
    guardrails (error rate, latency) and the decision: promote, rollback, stop (futility) or
    continue. Safe to run as often as you like: peeking does not inflate the error rate.
    """
    if metric not in ("binary", "continuous"):
        raise ConfigError(f"--metric must be binary or continuous, got {metric!r}")
    cfg = ABConfig(
        metric=metric,  # type: ignore[arg-type]
        alpha=alpha,
        mde=mde,
        horizon=horizon,
        champion=champion,
        challenger=challenger,
        higher_is_better=not lower_is_better,
        latency_ms=latency_ms,
    )
    folder = log_dir if log_dir is not None else Path("runs") / "serve" / name
    result = analyse(read_log(folder), cfg)
    if as_json:
        print(json.dumps({"action": result.decision.action, **result.evidence_dict()}, indent=2))
    else:
        _print(result, Console(soft_wrap=True))
    if html is not None:
        try:
            html.parent.mkdir(parents=True, exist_ok=True)
            html.write_text(render(result, name), encoding="utf-8")
        except OSError as err:
            raise write_failed(err, html) from None
        if not as_json:
            print(f"report: {html}")
    if apply:
        done = apply_decision(open_registry(registry, key_env), name, result)
        if not as_json:
            print(f"applied: {done}" if done else "applied: nothing to move (continue)")


__all__ = ["ab_report", "apply_decision"]
