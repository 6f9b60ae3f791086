"""The training loop: ``fit()`` → ``train_step()`` → ``forward_backward()``, with plugins around it."""

from __future__ import annotations

import contextlib
import math
import time
import traceback
import warnings
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from vatra.config import Config
from vatra.config._parallel import check_world
from vatra.data import Batch, DataContext, DatasetSpec, GlobalBatchSampler, build_dataset
from vatra.data.held import given_datasets
from vatra.data.loader import eval_batches
from vatra.engine._plugin import Plugin, PluginList
from vatra.engine.batches import Sampler, train_batches
from vatra.engine.contract import check_inputs, check_loss_shapes
from vatra.engine.dist import DistContext
from vatra.engine.objective import Objective, as_loss_module, call_model, rank_seed, seed_everything
from vatra.engine.optim import build_optimizer, build_scheduler
from vatra.engine.phases import phase
from vatra.engine.state import TrainState
from vatra.engine.steps import MicroSteps, PlainSteps
from vatra.errors import ConfigError
from vatra.losses import build_loss, build_metrics, resolve_task
from vatra.models import build_model
from vatra.rundir import RunDir

if TYPE_CHECKING:
    from vatra.parallel import Parallel

# A skipped update (healing) steps the schedule without optimizer.step(): intended, not a mistake.
warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")


class Trainer:
    """Trains one model on this rank's share of the data; works with or without torch.distributed.

    ``train`` and ``val`` are any torch datasets that follow the batch contract
    (:mod:`vatra.data._base`); ``loss`` is a function or module ``(output, target) -> Tensor`` (default:
    the task's loss from ``train.loss``). Federated clients, HPO trials and parameter-server workers
    build a ``Trainer`` on their own data (``world_size == 1``, no process group) and call
    :meth:`train_step` or :meth:`fit`.
    """

    def __init__(
        self,
        cfg: Config,
        model: nn.Module,
        train: Any,
        val: Any | None,
        spec: DatasetSpec,
        sampler: Sampler | None = None,
        *,
        loss: Any = None,
        dist: DistContext | None = None,
        plugins: Iterable[Plugin] = (),
        run_dir: RunDir | None = None,
    ) -> None:
        self.cfg = cfg
        self.dist = dist or DistContext()
        self.spec = spec
        self.task = resolve_task(cfg.train.task, spec)
        self.train_data = train
        self.val_data = val
        self.plugins = PluginList(plugins)
        self.run_dir = run_dir
        self.state = TrainState()
        device = self.dist.device
        self.model = model.to(device)
        self.loss = as_loss_module(build_loss(cfg.train, spec) if loss is None else loss).to(device)
        self._user_loss = loss is not None
        self._first_batch = True  # its inputs and shapes are checked (engine.contract) before any step
        # What the optimizer trains: the model, or the model and a loss with parameters of its own.
        self.trainable: nn.Module = self.model
        if any(True for _ in self.loss.parameters()):
            self.trainable = Objective(self.model, self.loss)
        self.module: nn.Module = self.trainable  # what runs forward: the DDP wrapper when distributed
        self._pipeline_scale = 1.0  # parallel.pp: the scale of the current micro-step's loss
        # parallel.fsdp/tp: the model is sharded in place over a device mesh, instead of wrapped in DDP
        self.parallel: Parallel | None = None
        if not cfg.parallel.is_default():
            check_world(cfg.parallel, self.dist.world_size)
            if cfg.parallel.enabled:
                from vatra.parallel import parallelize  # DTensor's machinery: only when asked for

                # pp: one micro-batch of token ids to time the blocks on (pipelines split gpt only)
                micro = max(1, cfg.train.batch_size // cfg.parallel.n_microbatches)
                vocab = max(spec.num_classes, 1)
                example = torch.randint(0, vocab, (micro, *spec.input_shape), generator=torch.Generator())
                self.parallel = parallelize(
                    cfg.parallel,
                    self.trainable,
                    self.model,
                    device,
                    loss_fn=self._pipeline_loss,
                    example=example.to(device),
                )
                if self.parallel.pipeline is not None:  # this rank trains its stage of the model
                    self.model = self.trainable = self.module = self.parallel.pipeline.module
        # dist.mode = diloco: every rank steps on its own gradients, synchronised by the mode's plugin;
        # hybrid: DDP inside the rank's group
        ddp = cfg.dist.mode in ("sync", "local_sgd", "hybrid")
        if self.dist.distributed and self.parallel is None and ddp:
            ids = [device.index] if device.type == "cuda" else None
            group = self._hybrid_group() if cfg.dist.mode == "hybrid" else None
            # gradient_as_bucket_view: each gradient is a view into its DDP bucket, so the averaged
            # bucket is not copied back into .grad after every step
            self.module = DDP(
                self.trainable,
                device_ids=ids,
                bucket_cap_mb=cfg.dist.bucket_cap_mb,
                process_group=group,
                gradient_as_bucket_view=True,
            )
        self.batches, self.sampler = train_batches(
            cfg, train, sampler, rank=self.data_rank, world=self.data_world, device=device
        )
        self._params = list(self.trainable.parameters())
        self.optimizer = build_optimizer(self._params, cfg.optim)
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, cfg.train.steps)
        amp = cfg.train.precision
        self.autocast_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(amp)
        self.scaler = torch.amp.GradScaler(device.type, enabled=amp == "fp16")
        # how a step's micro-batches run: a plugin's strategy (balance.adaptive syncs the gradients
        # itself, diloco.adaptive_steps sits steps out), else the plain one
        self.micro_steps = self._pick_micro_steps()
        # train.compile: forward_backward runs a torch.compile wrapper of what runs forward (lazy: the
        # first step compiles); self.module (DDP comm hooks are registered on it) and self.model
        # (checkpoints name its parameters) stay the modules themselves. parallel layouts refuse it.
        self._compiled: dict[nn.Module, nn.Module] = {}
        if cfg.train.compile:
            forward = self.micro_steps.forward_module(self)
            self._compiled[forward] = cast(nn.Module, torch.compile(forward))

    def _pick_micro_steps(self) -> MicroSteps:
        offered = [(type(p).__name__, s) for p in self.plugins if (s := p.micro_steps(self)) is not None]
        if len(offered) > 1:
            raise ConfigError(
                f"plugins {', '.join(name for name, _ in offered)} each change how a step's micro-batches "
                "run; keep one of them"
            )
        return offered[0][1] if offered else PlainSteps()

    def _hybrid_group(self) -> torch.distributed.ProcessGroup:
        """``dist.mode = "hybrid"``: this rank's group of ``hybrid.group_size`` contiguous ranks
        (a collective: every rank creates every group)."""
        size, world = self.cfg.hybrid.group_size, self.dist.world_size
        if world % size:
            raise ConfigError(
                f"hybrid.group_size = {size} does not divide the world size {world}; give a divisor of "
                f"{world} (the ranks of one host: dist.nproc)"
            )
        groups = [list(range(g, g + size)) for g in range(0, world, size)]
        group, _ = torch.distributed.new_subgroups_by_enumeration(groups)
        assert group is not None
        return group

    @property
    def data_rank(self) -> int:
        """Which share of the data this rank reads: its rank, or under ``parallel`` its index among
        the data-parallel ranks (tensor-parallel and pipeline peers read the same batches)."""
        return self.dist.rank if self.parallel is None else self.parallel.data_rank

    @property
    def data_world(self) -> int:
        """Ranks that read different data: the world size, or ``parallel.dp × parallel.fsdp``."""
        return self.dist.world_size if self.parallel is None else self.parallel.data_world

    @classmethod
    def from_config(
        cls,
        cfg: Config,
        *,
        model: nn.Module | None = None,
        train: Any = None,
        val: Any = None,
        loss: Any = None,
        dist: DistContext | None = None,
        plugins: Iterable[Plugin] = (),
        run_dir: RunDir | None = None,
    ) -> Trainer:
        """Data, model and loss as the config says (or as given), seeded so runs repeat exactly.

        Data comes from ``data.*`` unless ``train`` is given (then ``val`` is what is given, None =
        no evaluation); the model from ``model.*`` unless given; the loss from ``train.loss``.
        """
        ctx = dist or DistContext()
        seed = cfg.run.seed
        data_ctx = DataContext(
            seed=seed,
            rank=ctx.rank,
            world_size=ctx.world_size,
            run_dir=run_dir.path if run_dir is not None else None,
            broadcast=ctx.broadcast_object,
            task=cfg.train.task,
            head_tasks={name: h.task for name, h in cfg.train.multitask.heads.items()},
            keep=cfg.meta.kept_columns(),  # meta.task_column: the tasks' names, not a feature
        )
        if train is None:
            if val is not None:
                raise ConfigError("vatra.fit: val= was given without train=; pass both, or neither")
            train, val, spec = build_dataset(cfg.data, data_ctx, cfg.train.task)
        else:  # a DataFrame or (X, y) arrays become datasets; a dataset's spec is read off its first item
            train, val, spec = given_datasets(train, val, cfg.data, data_ctx)
        if model is None:
            seed_everything(seed)  # identical initial weights on every rank
            heads = {name: h.size for name, h in cfg.train.multitask.heads.items()}
            model = build_model(cfg.model, spec, heads)
        # per-rank dropout and anything random after; tensor-parallel and pipeline peers draw alike
        # (their replicated activations must stay equal)
        seed_everything(rank_seed(seed, cfg.parallel.data_rank(ctx.rank)))
        return cls(cfg, model, train, val, spec, loss=loss, dist=ctx, plugins=plugins, run_dir=run_dir)

    # ------------------------------------------------------------------ loop
    def fit(self) -> dict[str, Any]:
        """Train to ``train.steps``; returns the summary (written by the run-folder plugin)."""
        start = time.perf_counter()
        try:
            self.plugins.on_fit_start(self)
            every, last = self.cfg.train.eval_every, self.cfg.train.steps
            evaluated_at = -1  # the step of the latest evaluation in a step's record
            while self.state.step < last and not self.state.should_stop:
                metrics = self.train_step()
                step = self.state.step
                # the final evaluation is the last step's record (metrics.jsonl, plots), not an extra
                if self.val_data is not None and ((every and step % every == 0) or step >= last):
                    metrics.update(self.evaluate())
                    evaluated_at = step
                self.plugins.on_step_end(self, metrics)
                self.state.last_metrics = metrics
            final_eval: dict[str, Any] = {}
            if self.val_data is not None:  # stopped early, rolled back, or resumed at the end: evaluate now
                final_eval = (
                    dict(self.state.last_eval) if evaluated_at == self.state.step else self.evaluate()
                )
            summary = self._summary(time.perf_counter() - start, final_eval)
            self.plugins.on_fit_end(self, summary)
            return summary
        except BaseException as exc:
            # root-cause analysis (monitor.rca), when a plugin offers it
            cause = self.plugins.explain(self, exc)
            with contextlib.suppress(OSError):  # a full disk must not replace the error that stopped the run
                self.log_event(
                    "failure",
                    error=f"{type(exc).__name__}: {exc}",
                    traceback=traceback.format_exc(limit=8),
                    **({"cause": cause} if cause else {}),
                )
            self.plugins.on_failure(self, exc)
            raise
        finally:
            self.batches.close()

    def train_step(self) -> dict[str, Any]:
        """One optimizer step over ``train.grad_accum`` micro-batches; returns the step's metrics."""
        t0 = time.perf_counter()
        state, accum = self.state, self.cfg.train.grad_accum
        state.skip_update = False
        self.plugins.on_step_start(self)
        lr = self.scheduler.get_last_lr()[0]
        work = self.micro_steps.run(self, accum)
        if work is None:
            return self._sat_out_step(t0, float(lr))
        if self.parallel is not None:
            self.parallel.after_backward()  # pp: the tied weights' gradients, summed once per step
        to = time.perf_counter()
        grad_norm = self._unscale_and_clip()
        state.extras["grad_norm"] = grad_norm  # pre-clip and identical on every rank: healing decides on it
        loss = work.loss_sum.item() / accum  # this rank's mean loss (unweighted)
        # fp16's loss scale overflowed: the scaler skips this update and lowers its scale by itself, so
        # healing and the monitor leave the step alone (a non-finite loss is still a fault).
        overflow = self.scaler.is_enabled() and not math.isfinite(grad_norm) and math.isfinite(loss)
        state.extras["amp_overflow"] = overflow
        self.plugins.after_backward(self)
        if not state.skip_update:
            with phase("optimizer"):
                self.scaler.step(self.optimizer)
                self.scaler.update()
        self.scheduler.step()
        state.step += 1
        self.plugins.after_update(self)
        step_time = time.perf_counter() - t0
        batch = self.global_batch * accum
        state.samples_seen += batch
        state.train_time_s += step_time
        metrics: dict[str, Any] = {
            "step": state.step,
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "samples_per_s": batch / step_time,
            "step_time_s": step_time,
            "data_time_s": work.data_time,
            "fwd_bwd_time_s": work.fwd_bwd_time,
            "optim_time_s": time.perf_counter() - to,
            "skipped": state.skip_update,
        }
        if self.scaler.is_enabled():
            metrics["amp_overflow"] = overflow
            metrics["loss_scale"] = self.scaler.get_scale()
        if self.parallel is not None:
            metrics.update(self.parallel.step_metrics())  # pp: the stage's compute and bubble
        return metrics

    def _sat_out_step(self, t0: float, lr: float) -> dict[str, Any]:
        """A step this rank sits out (its micro-steps strategy ran nothing: ``diloco.adaptive_steps``
        on a slow rank): no data is read and nothing is computed, but the step counts and the LR
        schedule moves on, so every rank's step counter stays the same. Loss and gradient norm repeat
        the last step's."""
        state = self.state
        self.scheduler.step()
        state.step += 1
        self.plugins.after_update(self)
        step_time = time.perf_counter() - t0
        state.train_time_s += step_time
        last = state.last_metrics
        return {
            "step": state.step,
            "loss": last.get("loss", math.nan),
            "lr": lr,
            "grad_norm": last.get("grad_norm", 0.0),
            "samples_per_s": 0.0,
            "step_time_s": step_time,
            "data_time_s": 0.0,
            "fwd_bwd_time_s": 0.0,
            "optim_time_s": 0.0,
            "skipped": False,
            "idle": True,
        }

    def forward_backward(
        self, inputs: Any, target: Any, *, scale: float = 1.0, module: nn.Module | None = None
    ) -> torch.Tensor:
        """Loss of one micro-batch and its gradient (scaled by ``scale``); returns the detached loss.
        ``module``: what runs forward (default: the DDP wrapper when distributed). Under ``parallel.pp``
        the pipeline schedule runs forward and backward of the batch's pipeline micro-batches."""
        pipeline = self.parallel.pipeline if self.parallel is not None else None
        if pipeline is not None:
            self._pipeline_scale = scale
            with self._autocast():
                return pipeline.step(inputs, target, sync_tied=False) / scale
        module = self.module if module is None else module
        module = self._compiled.get(module, module)  # train.compile: the compiled wrapper
        first, self._first_batch = self._first_batch, False
        if first:
            check_inputs(self.model, inputs)
        with self._autocast(), phase("forward"):
            if self.trainable is self.model:
                output = call_model(module, inputs)
                if first and self._user_loss:
                    check_loss_shapes(output, target)
                loss = self.loss(output, target)
            else:
                loss = module(inputs, target)  # Objective: the loss's own parameters train too
        with phase("backward"):
            self.scaler.scale(loss * scale if scale != 1.0 else loss).backward()
        return loss.detach()

    @property
    def global_batch(self) -> int:
        """Samples per micro-step over all ranks."""
        if isinstance(self.sampler, GlobalBatchSampler):
            return self.sampler.global_batch
        return self.cfg.train.batch_size * self.data_world

    @property
    def loss_weight(self) -> float:
        """What this rank's mean loss is multiplied by before backward, so that DDP's average of the
        ranks' gradients is the gradient of the mean loss over the union batch: W · b_r / B with uneven
        per-rank batches b_r (sum B, W ranks), 1 with even ones."""
        if isinstance(self.sampler, GlobalBatchSampler):
            return self.dist.world_size * self.sampler.batch_size / self.sampler.global_batch
        return 1.0

    def _pipeline_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The last pipeline stage's loss of one pipeline micro-batch, scaled as the micro-step's."""
        return self.loss(output, target) * self._pipeline_scale

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.dist.device.type, dtype=self.autocast_dtype)

    def next_batch(self) -> Batch:
        """The next training batch ``(inputs, target)`` of this rank, on its device."""
        return self.batches.next()

    def _unscale_and_clip(self) -> float:
        """The global gradient norm before clipping (clipping only with ``train.clip_grad_norm``).

        NOTE: ``float()`` is a device-host sync point; healing and the metrics need the value.
        Without clipping only the norm is computed (clip_grad_norm_ with an infinite bound still
        multiplies every gradient by 1: ~0.2 ms a step on a 0.2 M-parameter model here).
        """
        self.scaler.unscale_(self.optimizer)
        grads = [p.grad for p in self._params if p.grad is not None]
        if self.parallel is not None:  # sharded gradients: their squares summed over the mesh
            from vatra.parallel import clip_

            total = self.parallel.grad_norm(grads)
            if self.cfg.train.clip_grad_norm:
                clip_(grads, self.cfg.train.clip_grad_norm, total)
            return total
        if grads and all(g.device == grads[0].device and g.dtype == grads[0].dtype for g in grads):
            # one fused kernel over all gradients; get_total_norm's grouping costs ~80 us more here
            norm = torch.stack(torch._foreach_norm(grads, 2.0)).norm()
        else:
            norm = torch.nn.utils.get_total_norm(grads)
        if self.cfg.train.clip_grad_norm:
            torch.nn.utils.clip_grads_with_norm_(self._params, self.cfg.train.clip_grad_norm, norm)
        return float(norm)

    # ------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(self) -> dict[str, Any]:
        """The task's metrics on the validation data, each rank a share, summed across ranks."""
        if self.val_data is None:
            return {}
        self.module.eval()
        metrics = build_metrics(self.task, self.cfg.train, self.spec, self.loss).to(self.dist.device)
        alone = not self.dist.distributed  # without collectives: the whole validation set here
        batches: Iterable[tuple[Batch, bool]] = (
            (batch, True)
            for batch in eval_batches(
                self.val_data,
                rank=0 if alone else self.data_rank,
                world_size=1 if alone else self.data_world,
                batch_size=self.cfg.train.eval_batch_size,
                workers=self.cfg.data.workers,
                device=self.dist.device,
            )
        )
        if self.parallel is not None and self.data_world > 1:
            batches = self.parallel.lockstep(batches)
        with self._autocast():
            for (inputs, target), counted in batches:
                # the plain module: evaluation needs no gradient sync (pp: None but on the last stage)
                output = self._eval_forward(inputs)
                if counted and output is not None:
                    metrics.update(output, target)
        if self.dist.distributed and not self.spec.num_classes:
            # A rank with no validation batch cannot size its sums: agree on the class count first.
            known = torch.tensor([metrics.num_classes], dtype=torch.int64)
            torch.distributed.all_reduce(known, op=torch.distributed.ReduceOp.MAX)
            metrics.num_classes = int(known.item())
        totals = metrics.state()
        if self.parallel is None:
            self.dist.all_reduce_sum(totals)
        else:  # over the data-parallel ranks only: their peers evaluated the same batches
            torch.distributed.all_reduce(totals, group=self.parallel.data_group)
            if self.parallel.pipeline is not None:  # the last stage's sums, on every stage
                self.parallel.pipeline.from_last(totals)
        self.module.train()
        values = {f"val_{k}": v for k, v in metrics.compute(totals).items()}
        self.state.last_eval = values
        self.plugins.on_eval_end(self, values)
        return values

    def _eval_forward(self, inputs: Any) -> Any:
        if self.parallel is not None and self.parallel.pipeline is not None:
            return self.parallel.pipeline.forward_only(inputs)
        return call_model(self.model, inputs)

    # --------------------------------------------------------------- helpers
    def log_event(self, kind: str, **fields: Any) -> None:
        """Record an event in events.jsonl (when there is a run folder) and tell the plugins
        (``on_event``: the console's line for it)."""
        if self.run_dir is not None:
            self.run_dir.log_event(kind, rank=self.dist.rank, step=self.state.step, **fields)
        self.plugins.on_event(self, kind, {"step": self.state.step, **fields})

    def _summary(self, wall_s: float, final_eval: dict[str, Any]) -> dict[str, Any]:
        st = self.state
        summary: dict[str, Any] = {
            "steps": st.step,
            "task": self.task,
            "final_loss": st.last_metrics.get("loss"),
            **final_eval,
            "samples_per_s": st.samples_seen / st.train_time_s if st.train_time_s else 0.0,
            "wall_s": wall_s,
            "world_size": self.dist.world_size,
            "samples_seen": st.samples_seen,
        }
        weights = getattr(self.loss, "weights", None)
        if callable(weights):
            summary["loss_weights"] = weights()
        provenance = getattr(self.train_data, "provenance", None)  # where the rows came from (delta)
        if isinstance(provenance, dict):
            summary["data"] = provenance
        return summary
