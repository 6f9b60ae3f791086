"""What a federated run leads with: the task's main metric, as ``vatra train`` picks it.

Classification reports ``global_accuracy``, regression ``global_r2``, ranking ``global_ndcg@k``, a
multitask run ``global_loss`` and each head's own (``global_<head>_accuracy``, ...): the server's
figure when it scores its own data, else the clients' weighted one. The round lines, the summary
and ``rounds_to_target`` (on ``federated.target_metric``) use the same names.
"""

from __future__ import annotations

from typing import Any

from vatra.config import Config
from vatra.errors import ConfigError
from vatra.losses import head_main_metrics, lower_is_better, main_metric


def _fmt(value: Any) -> str:
    return "-" if value is None else f"{value:.4f}"


def _last(rows: list[dict[str, Any]], key: str) -> Any:
    """The newest value of ``key`` (rows without a client evaluation leave it out)."""
    return next((r[key] for r in reversed(rows) if r.get(key) is not None), None)


class Headline:
    """The run's main metric (``main``), each multitask head's (``heads``) and the target's, from the
    names the task's evaluation reports (``loss``, ``mae``, ``rmse``, ``r2``, ...)."""

    def __init__(self, cfg: Config, names: list[str], multitask: bool) -> None:
        fcfg = cfg.federated
        self.names = names
        self.main = main_metric(names) or "loss"
        self.heads = head_main_metrics(names, cfg.train.multitask.heads) if multitask else []
        self.target_metric = self.main if fcfg.target_metric == "auto" else fcfg.target_metric
        if self.target_metric not in names:
            raise ConfigError(
                f"federated.target_metric: {fcfg.target_metric!r} is not a metric of this task; "
                f"choose auto or one of: {', '.join(names)}"
            )
        self.target = fcfg.target_accuracy if fcfg.target_value is None else fcfg.target_value
        self.lower = lower_is_better(self.target_metric)
        self.shown = list(dict.fromkeys([self.main, *self.heads, self.target_metric]))

    def add_globals(self, out: dict[str, Any]) -> None:
        """``global_<metric>`` for every shown metric: the server's figure, else the clients'."""
        for name in self.shown:
            out[f"global_{name}"] = out.get(f"server_{name}", out.get(f"client_{name}"))

    def round_figures(self, m: dict[str, Any]) -> str:
        """``global_r2 0.4123 worst 0.3011``: the round's main figures for its console line."""
        parts = [f"global_{name} {_fmt(m.get(f'global_{name}'))}" for name in (self.main, *self.heads)]
        return " ".join([*parts, f"worst {_fmt(m.get(f'worst_client_{self.main}'))}"])

    def reached(self, value: float) -> bool:
        return value <= self.target if self.lower else value >= self.target

    def summary(self, ordered: list[dict[str, Any]]) -> dict[str, Any]:
        """The main figures of the last round (each task metric's newest value), the best, the target."""
        last = ordered[-1]
        out: dict[str, Any] = {"main_metric": self.main}
        # every task metric seen, as vatra train's summary has each val_ one
        for side in ("server", "client"):
            for name in self.names:
                if (value := _last(ordered, f"{side}_{name}")) is not None or name == self.main:
                    out[f"{side}_{name}"] = value
        for name in self.shown:
            out[f"global_{name}"] = last.get(f"global_{name}")
        for name in (self.main, *self.heads):
            scored = [m[f"global_{name}"] for m in ordered if m.get(f"global_{name}") is not None]
            best = min if lower_is_better(name) else max
            out[f"best_global_{name}"] = best(scored, default=None)
            out[f"mean_client_{name}"] = _last(ordered, f"mean_client_{name}")
            out[f"worst_client_{name}"] = _last(ordered, f"worst_client_{name}")
        key = f"global_{self.target_metric}"
        reached = [m["round"] for m in ordered if m.get(key) is not None and self.reached(m[key])]
        out.update(target_metric=self.target_metric, target=self.target)
        out["rounds_to_target"] = reached[0] if reached else None
        return out

    def done_line(self, summary: dict[str, Any]) -> str:
        m = self.main
        op = "<=" if self.lower else ">="
        return (
            f"done: {summary['rounds']} rounds, global {m} {_fmt(summary[f'global_{m}'])}, "
            f"mean client {_fmt(summary[f'mean_client_{m}'])}, "
            f"worst client {_fmt(summary[f'worst_client_{m}'])}, "
            f"rounds to {self.target_metric} {op} {self.target:g}: {summary['rounds_to_target']}"
        )
