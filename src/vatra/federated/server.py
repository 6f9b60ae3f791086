"""The round loop shared by simulation and deployment: select, configure, fit, aggregate, evaluate, log.

Only *how clients train and evaluate* differs between the two (an :class:`~vatra.federated._base.Executor`:
a process pool, or gRPC clients). The server never holds client data: it scores the global model on
its own held-out data when it has some (``--eval-data``; a simulation's validation split) and
aggregates what clients report about their own held-out rows. ``global_<metric>`` (the task's main
metric, :mod:`vatra.federated.headline`) is the server's figure when it has one, else the clients'
weighted one. The server saves its whole state after every
round as a version of the run's checkpoint store (:mod:`vatra.federated.checkpoint`) and a new
server on the same run folder resumes at the next round.
"""

from __future__ import annotations

import hashlib
import sys
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np

from vatra.config import Config
from vatra.data import DatasetSpec
from vatra.errors import VatraError
from vatra.federated import build_selector, build_strategy
from vatra.federated._base import (
    EvalRes,
    Executor,
    Failure,
    FitIns,
    FitRes,
    UploadHook,
    check_eval_numbers,
    check_fit_numbers,
)
from vatra.federated.checkpoint import ServerCheckpoints
from vatra.federated.client import initial_weights
from vatra.federated.compression import build_upload_hook
from vatra.federated.evaluate import Scorer, ServerEvaluator
from vatra.federated.headline import Headline
from vatra.federated.robust import screen
from vatra.federated.selection import evaluation_sample
from vatra.federated.wire import WireError, decode, encode
from vatra.losses import build_loss
from vatra.rundir import RunDir, append_jsonl, read_jsonl


def weights_digest(weights: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(weights, dtype=np.float32).tobytes()).hexdigest()


class _RoundBar:
    """A rich progress bar over rounds (terminals only; plain lines otherwise)."""

    def __init__(self, total: int, done: int, headline: Headline) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.bar = Progress(
            TextColumn("[bold]federated"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[figures]}  failed {task.fields[failed]}"),
            TimeRemainingColumn(),
        )
        self.bar.start()
        self.headline = headline
        self.task = self.bar.add_task("rounds", total=total, completed=done, figures="", failed=0)

    def update(self, rnd: int, m: dict[str, Any]) -> None:
        figures = self.headline.round_figures(m)
        self.bar.update(self.task, completed=rnd, figures=figures, failed=m["failures"])

    def stop(self) -> None:
        self.bar.stop()


class FederatedServer:
    def __init__(
        self,
        cfg: Config,
        spec: DatasetSpec,
        run_dir: RunDir,
        executor: Executor,
        *,
        eval_data: Any = None,
        hook: UploadHook | None = None,
        progress: bool = True,
    ) -> None:
        self.cfg = cfg
        self.fcfg = cfg.federated
        self.run_dir = run_dir
        self.executor = executor
        self.progress = progress
        model, layout, init = initial_weights(cfg, spec)
        self.hook = hook or build_upload_hook(cfg, layout)
        scorer = Scorer(cfg, model, spec, build_loss(cfg.train, spec))
        self.evaluator = ServerEvaluator(scorer, eval_data)
        self.headline = Headline(cfg, scorer.metric_names(), scorer.task == "multitask")
        self.strategy = build_strategy(self.fcfg, layout)
        self.selector = build_selector(self.fcfg, cfg.run.seed)
        self.round = 0  # rounds completed
        self.checkpoints = ServerCheckpoints(cfg, run_dir)
        if not self._resume():
            self.strategy.initialize(init, cfg.run.seed)

    # ------------------------------------------------------------ checkpoint
    def _save(self, metrics: dict[str, Any]) -> None:
        meta, arrays = self.strategy.state()
        chosen = self.selector.state()  # per-client arrays (adaptive) travel as tensors, not JSON lists
        facts = {
            "round": self.round,
            "strategy": meta,
            "selector": {k: v for k, v in chosen.items() if not isinstance(v, np.ndarray)},
            "metrics": metrics,
        }
        tensors = {f"strategy.{k}": v for k, v in arrays.items()}
        tensors.update({f"selector.{k}": v for k, v in chosen.items() if isinstance(v, np.ndarray)})
        blob = encode({**facts, "hook": self.hook.state()}, tensors)
        self.checkpoints.save_round(self.round, blob, metrics)  # a crash leaves the last round's version

    def _resume(self) -> bool:
        found = self.checkpoints.newest()
        if found is None:
            return False
        where, blob = found
        try:
            meta, tensors = decode(blob)
            arrays = {k.removeprefix("strategy."): v for k, v in tensors.items() if k.startswith("strategy.")}
            chosen = {k.removeprefix("selector."): v for k, v in tensors.items() if k.startswith("selector.")}
            self.strategy.load_state(meta["strategy"], arrays)
            self.selector.load_state({**meta["selector"], **chosen})
            self.round = int(meta["round"])
            if (
                not 0 <= self.round <= self.fcfg.rounds
                or len(self.strategy.weights) != self.strategy.layout.size
            ):
                raise ValueError("its round or model size does not match this config")
        except (WireError, KeyError, TypeError, ValueError, IndexError) as err:
            raise VatraError(
                f"server checkpoint {where} is unreadable ({type(err).__name__}: {err}); "
                "restore it, or move the run's checkpoints away to start this run folder over"
            ) from None
        logged = {m.get("round") for m in read_jsonl(self.run_dir.metrics)}
        if self.round not in logged:  # crashed between checkpoint and metrics line
            append_jsonl(self.run_dir.metrics, meta["metrics"])
        if isinstance(meta.get("hook"), dict):
            self.hook.load_state(meta["hook"])
        else:  # a checkpoint from before hook state was saved
            self.hook.resume(read_jsonl(self.run_dir.metrics))
        self.run_dir.log_event("resumed", round=self.round + 1)
        self._say(f"vatra: resuming at round {self.round + 1}/{self.fcfg.rounds} from {where}")
        return True

    # ----------------------------------------------------------------- loop
    def _say(self, line: str) -> None:
        if self.progress:
            print(line, file=sys.stdout, flush=True)

    def _aggregate(self, rnd: int, merged: list[FitRes], failures: list[Failure]) -> None:
        """Aggregate, keeping the previous model when the result is not finite (a poisoned round)."""
        meta, arrays = self.strategy.state()
        before = (meta, {k: np.array(v, copy=True) for k, v in arrays.items()})
        self.strategy.aggregate(rnd, merged, failures)
        bad = [
            k for k, v in self.strategy.state()[1].items() if v.dtype.kind == "f" and not np.isfinite(v).all()
        ]
        if bad:
            self.strategy.load_state(*before)
            self.run_dir.log_event("aggregate_rejected", round=rnd, reason=f"non-finite values in {bad}")

    def _checked(
        self,
        rnd: int,
        ins: dict[int, FitIns],
        replies: list[Any],
        check: Callable[[Any], str | None],
        phase: str,
    ) -> tuple[list[Any], list[Failure]]:
        """The replies whose numbers ``check`` accepts; each refusal is an ``update_rejected`` event
        and a Failure of its client for the round (none for an id that was sent no task)."""
        sent = Counter(r.client_id for r in replies)
        kept: list[Any] = []
        failures: dict[int, Failure] = {}
        for r in replies:
            reason: str | None
            if r.client_id not in ins or r.round != rnd:
                reason = f"a reply for client {r.client_id}, round {r.round}: no task of round {rnd}"
            elif sent[r.client_id] > 1:
                reason = f"client {r.client_id} sent {sent[r.client_id]} replies in round {rnd}"
            else:
                reason = check(r)
            if reason is None:
                kept.append(r)
                continue
            where = {"phase": phase} if phase != "fit" else {}
            self.run_dir.log_event("update_rejected", client=r.client_id, round=rnd, reason=reason, **where)
            if r.client_id in ins:
                failures.setdefault(r.client_id, Failure(r.client_id, f"rejected: {reason}"))
        return kept, list(failures.values())

    def _check_fit(self, res: FitRes) -> str | None:
        """Every number of a result that the server, the selector, the strategy or the hook reads."""
        return (
            check_fit_numbers(res)
            or self.selector.check_result(res)
            or self.strategy.check_result(res)
            or self.hook.check_result(res)
        )

    def _check_eval(self, rep: EvalRes) -> str | None:
        return check_eval_numbers(rep) or self.strategy.check_eval(rep)

    def evaluate(self, rnd: int, available: list[int]) -> dict[str, Any]:
        """The server's own score (when it has data) and, on evaluation rounds, the reports of a seeded
        sample of the available clients (``federated.evaluate_clients``; ``evaluate_asked`` of them
        asked, ``evaluated_clients`` of them held rows out and reported)."""
        out = self.evaluator.score(self.strategy.server_models())
        every = self.fcfg.evaluate_every
        if every and (rnd % every == 0 or rnd == self.fcfg.rounds):
            asked = evaluation_sample(self.cfg.run.seed, rnd, available, self.fcfg.evaluate_clients)
            ins = self.strategy.configure_evaluate(rnd, asked)
            reports, failures = self.executor.evaluate(rnd, ins)
            reports, rejected = self._checked(rnd, ins, reports, self._check_eval, "evaluate")
            for f in [*failures, *rejected]:
                self.run_dir.log_event("client_eval_failed", round=rnd, client=f.client_id, reason=f.reason)
            out.update(self.strategy.aggregate_evaluate(rnd, sorted(reports, key=lambda r: r.client_id)))
            out["evaluate_asked"] = len(asked)
        self.headline.add_globals(out)
        return out

    def run_round(self, rnd: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        available = self.executor.available()
        k = self.fcfg.clients_per_round or len(available)
        selected = self.selector.select(rnd, available, k)
        ins = self.strategy.configure_round(rnd, selected)
        results, failures, down, up = self.executor.fit(rnd, ins, self.strategy.update_size())
        # client-reported numbers out of range: the client fails the round before any state sees them
        results, rejected = self._checked(rnd, ins, results, self._check_fit, "fit")
        failures = [*failures, *rejected]
        results.sort(key=lambda r: r.client_id)  # aggregation order fixed: same sums everywhere
        # poisoning bounds (federated.robust): norms, sample counts, counts the clients declared
        results, screened = screen(results, self.fcfg.robust, getattr(self.executor, "declared", None))
        failures = [*failures, *screened]
        for f in failures:
            self.run_dir.log_event("client_failed", round=rnd, client=f.client_id, reason=f.reason)
        self.selector.observe(rnd, results, failures)
        merged = self.hook.combine(rnd, results)
        if len(results) >= self.fcfg.min_clients:
            self._aggregate(rnd, merged, failures)
        else:
            self.run_dir.log_event(
                "round_skipped", round=rnd, results=len(results), min_clients=self.fcfg.min_clients
            )
        t_fit = time.perf_counter()
        # a client that failed this round (silent, past the deadline, rejected) is not asked again:
        # one deadline per client per round
        failed = np.fromiter((f.client_id for f in failures), dtype=np.int64)
        pool = np.asarray(available, dtype=np.int64)
        metrics: dict[str, Any] = {"round": rnd, **self.evaluate(rnd, pool[~np.isin(pool, failed)].tolist())}
        durations = [float(r.metrics.get("duration_s", 0.0)) for r in results]
        losses = [float(r.metrics["train_loss"]) for r in results if "train_loss" in r.metrics]
        metrics.update(
            bytes_up=up,
            bytes_down=down,
            round_time_s=time.perf_counter() - t0,
            fit_time_s=t_fit - t0,
            selected=selected,
            failures=len(failures),
            client_time_s=max(durations, default=0.0),  # the slowest client: a synchronous round's floor
            train_loss=float(np.mean(losses)) if losses else None,
        )
        versions = {str(r.client_id): v for r in results if (v := _data_version(r.metrics))}
        if versions:  # owners training on Delta tables say which version (and schema) they read
            metrics["client_data"] = versions
        self.hook.round_metrics(rnd, metrics)
        return metrics

    def run(self) -> dict[str, Any]:
        start = time.perf_counter()
        total = self.fcfg.rounds
        if self.round == 0:
            self._say(
                f"vatra: federated {self.fcfg.strategy} on {self.fcfg.clients} clients, {total} rounds, "
                f"selection {self.fcfg.selection}"
            )
        bar = _RoundBar(total, self.round, self.headline) if self.progress and sys.stdout.isatty() else None
        try:
            while self.round < total:
                rnd = self.round + 1
                if not self.hook.allow_round(rnd):
                    break
                metrics = self.run_round(rnd)
                self.round = rnd
                self._save(metrics)
                append_jsonl(self.run_dir.metrics, metrics)
                line = (
                    f"round {rnd}/{total} {self.headline.round_figures(metrics)} "
                    f"selected {len(metrics['selected'])} failed {metrics['failures']} "
                    f"{metrics['round_time_s']:.2f} s"
                )
                if bar is not None:
                    bar.update(rnd, metrics)
                else:
                    self._say(line)
        finally:
            if bar is not None:
                bar.stop()
        summary = self.summary(time.perf_counter() - start)
        self.run_dir.write_summary(summary)
        if self.cfg.monitor.report:
            self._report(summary)
        self._say(self.headline.done_line(summary))
        return summary

    def _report(self, summary: dict[str, Any]) -> None:
        """report.html with the per-round curves (``monitor.report``); a plotting error only logs."""
        from vatra.monitor.aftercare import report_after_training

        report_after_training(self.run_dir.path, summary, self.run_dir.log_event)

    def summary(self, wall_s: float) -> dict[str, Any]:
        """Final figures, read back from metrics.jsonl so a resumed run counts every round once."""
        rows = {m["round"]: m for m in read_jsonl(self.run_dir.metrics)}
        ordered = [rows[r] for r in sorted(rows)]
        return {
            "strategy": self.fcfg.strategy,
            "selection": self.fcfg.selection,
            "clients": self.fcfg.clients,
            "rounds": ordered[-1]["round"],
            **self.headline.summary(ordered),
            "bytes_up": sum(m["bytes_up"] for m in ordered),
            "bytes_down": sum(m["bytes_down"] for m in ordered),
            "failures": sum(m["failures"] for m in ordered),
            "round_time_s": sum(m["round_time_s"] for m in ordered),
            "client_time_s": sum(m["client_time_s"] for m in ordered),
            "wall_s": wall_s,
            "weights_sha256": weights_digest(self.strategy.weights),
            **self.hook.summary(ordered),
        }


def _data_version(metrics: dict[str, Any]) -> dict[str, Any] | None:
    """A client's ``data_version`` and ``data_schema`` as they are logged, or None when it sent none.
    The wire has checked their shape (an int, a short string); they are only logged, never trusted."""
    version = metrics.get("data_version")
    if type(version) is not int:
        return None
    digest = metrics.get("data_schema")
    return {"version": version, "schema_hash": digest if isinstance(digest, str) else None}
