"""The ``vatra`` command line."""

from vatra.cli import balance as _balance  # noqa: F401  (registers balance train-agent)
from vatra.cli import ckpt as _ckpt  # noqa: F401  (registers the ckpt commands)
from vatra.cli import cluster as _cluster  # noqa: F401  (registers cluster up/run/down)
from vatra.cli import data as _data  # noqa: F401  (registers the data commands)
from vatra.cli import edge as _edge  # noqa: F401  (registers edge export)
from vatra.cli import energy as _energy  # noqa: F401  (registers energy schedule)
from vatra.cli import federated as _federated  # noqa: F401  (registers federate and fl)
from vatra.cli import meta as _meta  # noqa: F401  (registers meta and meta adapt)
from vatra.cli import model as _model  # noqa: F401  (registers the model registry commands)
from vatra.cli import model_ab as _model_ab  # noqa: F401  (registers model ab-report)
from vatra.cli import model_serve as _model_serve  # noqa: F401  (registers model serve)
from vatra.cli import plan as _plan  # noqa: F401  (registers plan)
from vatra.cli import predict as _predict  # noqa: F401  (registers predict and export)
from vatra.cli import profile as _profile  # noqa: F401  (registers profile)
from vatra.cli import report as _report  # noqa: F401  (registers report)
from vatra.cli import spot as _spot  # noqa: F401  (registers spot simulate)
from vatra.cli import train as _train  # noqa: F401  (registers the train and config commands)
from vatra.cli import tune as _tune  # noqa: F401  (registers tune)
from vatra.cli.app import app, main

__all__ = ["app", "main"]
