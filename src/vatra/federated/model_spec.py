"""Whether a joining client's data spec may size the server's model (deployment without ``--eval-data``).

The first client to join tells the server the shape of its data, and the server builds its model
from it. That spec is a claim from the network, so before it is used:

- :func:`check_spec` bounds its numbers: a known task kind, at most :data:`MAX_DIMS` input
  dimensions, every dimension, class count, head size and cardinality a positive (or, where 0
  means "unknown", non-negative) integer below 2³¹, at most :data:`MAX_NAMES` heads and
  categorical columns;
- :func:`model_floats` builds the model on the meta device (shapes only, nothing allocated, the
  RNG untouched) and counts its parameters;
- :func:`spec_problem` refuses a model whose largest message would not fit
  ``federated.max_message_mb`` (:func:`max_model_floats`): the server listens with that cap until
  it knows the model's size, so a larger model could never be sent, and would have cost the
  server its memory first.
"""

from __future__ import annotations

import math
from typing import get_args

import torch

from vatra.config import Config
from vatra.data import DatasetSpec, TaskKind
from vatra.federated.params import ParamLayout
from vatra.models import build_model

MAX_DIMS = 8  # input dimensions of one sample: (features,), (C, H, W), (items, features), ...
MAX_NAMES = 1024  # multitask heads, categorical columns
MAX_SIZE = 2**31 - 1  # any one dimension, class count or cardinality
HEAD_KINDS = ("classification", "multilabel", "regression")  # TargetSpec.kind
HEADER_BYTES = 64 * 1024  # safetensors header + JSON metadata (metrics, config) of one message
PEER_BYTES = 1024  # secure aggregation: a key, a ciphertext or a share per other client


def _count(value: object, what: str, low: int) -> int:
    if type(value) is not int or not low <= value <= MAX_SIZE:
        raise ValueError(f"{what} must be an integer in [{low}, {MAX_SIZE}], got {value!r}")
    return value


def check_spec(spec: DatasetSpec) -> None:
    """ValueError naming the first number of ``spec`` no model could be built from."""
    if spec.kind not in get_args(TaskKind):
        raise ValueError(f"kind must be one of {', '.join(get_args(TaskKind))}, got {spec.kind!r}")
    if len(spec.input_shape) > MAX_DIMS:
        raise ValueError(f"input_shape has {len(spec.input_shape)} dimensions, at most {MAX_DIMS}")
    for d in spec.input_shape:
        _count(d, "every input_shape dimension", 1)
    _count(math.prod(spec.input_shape), "the input size (the product of input_shape)", 1)
    _count(spec.num_classes, "num_classes", 0)  # 0: the data does not say
    if spec.image_shape is not None:
        if len(spec.image_shape) != 3:
            raise ValueError(f"image_shape must be (C, H, W), got {list(spec.image_shape)}")
        for d in spec.image_shape:
            _count(d, "every image_shape dimension", 1)
    for what, named in (("heads", spec.heads), ("categorical", spec.categorical)):
        if len(named) > MAX_NAMES:
            raise ValueError(f"{len(named)} {what}, at most {MAX_NAMES}")
    for name, head in spec.heads.items():
        if head.kind not in HEAD_KINDS:
            raise ValueError(f"head {name!r} has kind {head.kind!r}")
        _count(head.size, f"the size of head {name!r}", 0)  # 0: the config sets it
    for name, n in spec.categorical.items():
        _count(n, f"the cardinality of categorical column {name!r}", 1)


def model_floats(cfg: Config, spec: DatasetSpec) -> int:
    """Parameters of the config's model for ``spec``, built on the meta device (no memory used)."""
    with torch.device("meta"):
        model = build_model(cfg.model, spec)
    return ParamLayout.of(model).size


def max_model_floats(cfg: Config) -> int:
    """The most parameters a model may have for its largest message (a fit instruction with every
    cluster model, secure-aggregation stages with a field per peer) to fit ``federated.max_message_mb``."""
    fc = cfg.federated
    models = fc.clusters if fc.strategy == "clustered" else 1
    peers = fc.clients if fc.secure_aggregation.enabled else 0
    room = int(fc.max_message_mb * 2**20) - HEADER_BYTES - peers * PEER_BYTES
    return max(room, 0) // (4 * models)


def spec_problem(cfg: Config, spec: DatasetSpec) -> str | None:
    """Why the server must not build its model from ``spec``, or None when it may."""
    try:
        check_spec(spec)
    except ValueError as err:
        return f"its data spec is out of range: {err}"
    try:
        floats = model_floats(cfg, spec)
    except Exception as err:  # the model's builder (possibly a user's) refused these shapes
        return f"model {cfg.model.name!r} cannot be built for its data ({type(err).__name__}: {err})"
    cap = max_model_floats(cfg)
    if floats > cap:
        return (
            f"its data would make a {floats:,}-parameter model, over the {cap:,} that fit "
            f"federated.max_message_mb = {cfg.federated.max_message_mb:g}"
        )
    return None
