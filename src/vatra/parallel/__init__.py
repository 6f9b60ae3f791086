"""Models bigger than one device: FSDP2, tensor and pipeline parallelism on one device mesh."""

from vatra.config._parallel import check_world
from vatra.parallel.apply import Parallel, parallelize
from vatra.parallel.fsdp import apply_fsdp, blocks_of
from vatra.parallel.grads import clip_, total_norm
from vatra.parallel.mesh import AXES, Mesh
from vatra.parallel.pipeline import GPTStage, Pipeline, StageClock, StageUnion, build_pipeline, stage_ids
from vatra.parallel.split import measure_block_costs, split_stages
from vatra.parallel.tp import apply_tp, gpt_plan, gpt_sequence_plan, resolve_plan

__all__ = [
    "AXES",
    "GPTStage",
    "Mesh",
    "Parallel",
    "Pipeline",
    "StageClock",
    "StageUnion",
    "apply_fsdp",
    "apply_tp",
    "blocks_of",
    "build_pipeline",
    "check_world",
    "clip_",
    "gpt_plan",
    "gpt_sequence_plan",
    "measure_block_costs",
    "parallelize",
    "resolve_plan",
    "split_stages",
    "stage_ids",
    "total_norm",
]
