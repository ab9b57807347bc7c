"""A Role: this rank's stage of one model, with its optimizer when it trains.

SFT trains one role (the policy), the reward-model stage another (the reward model), and RL
drives four (actor, reference, critic, reward) in the same processes. Trainers only call
`train_step`, `forward_backward` and `evaluate`; megatron-core's schedule does microbatching,
the pipeline (1F1B) and the gradient all-reduce, so the same code runs at any TP/PP/DP.

Loss contract. A trainer's `loss_fn(batch, output)` returns `(loss_sum, count, metrics)`:
`loss_sum` is a sum over units (tokens, pairs, sequences), `count` the number of units (int
tensor), and `metrics` maps a name to a float tensor `[sum, count]`. megatron-core divides the
gradients by the count summed over microbatches and DP ranks, so a step optimises the mean over
the *global* batch, identically in every parallel layout.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from megarl.config.schema import FP8Config, LRScheduleConfig, ModelConfig, OptimConfig, ParallelConfig
from megarl.models.gpt import build_model
from megarl.optim import build_optimizer, build_scheduler
from megarl.roles.microbatch import MicroBatch
from megarl.runtime.distributed import broadcast_from_last_stage, device, dp_means

# a MicroBatch (roles/microbatch.py), or a dict of its model keys and data keys
Batch = MicroBatch | dict
LossFn = Callable[[MicroBatch, torch.Tensor], tuple]


@dataclass
class StepResult:
    metrics: dict  # name -> global mean over the step's batch (identical on every rank)
    grad_norm: float
    lr: float
    skipped: bool  # fp16 overflow: the optimizer skipped this step


class Role:
    """Built in separable steps (`build_module`, `freeze`, `wrap`, `attach_optimizer`) so that
    offload hooks and other roles' variations attach between them; the constructor runs them
    all in order."""

    def __init__(self, name: str, model_cfg: ModelConfig, parallel: ParallelConfig, *,
                 head: str = "lm", precision: str = "fp32", fp8: FP8Config | None = None, seed: int = 1234,
                 optim: OptimConfig | None = None, schedule: LRScheduleConfig | None = None,
                 train_steps: int = 1, train_only_head: bool = False):
        self.name, self.model_cfg, self.head, self.precision = name, model_cfg, head, precision
        if model_cfg.lora is not None and head != "lm":
            raise ValueError(f"role {name}: model.lora adapts a language model (sft, rl's actor); a scalar-head "
                             "model (reward model, critic) trains dense: leave model.lora unset for it")
        # a reward model's pooling of its per-token values into one reward (reward_model.pooling);
        # saved in its checkpoint's manifest, so that RL reads the model as it was trained
        self.reward_pooling: str | None = None
        self.parallel = parallel
        self.optimizer = self.scheduler = None
        self.accumulating = False  # gradients of a step are in the buffers, not yet applied
        gpt = self.build_module(seed=seed, fp8=fp8)
        self.freeze(gpt, trainable=None if optim is None else ("output_layer." if train_only_head else ""),
                    adapters_only=model_cfg.lora is not None)
        self.chunks = [self.wrap(gpt, trained=optim is not None)]  # one per virtual pipeline stage
        if optim is not None:
            self.attach_optimizer(optim, schedule or LRScheduleConfig(), train_steps)

    # -- construction steps ---------------------------------------------------------------

    def build_module(self, *, seed: int, fp8: FP8Config | None):
        gpt = build_model(self.model_cfg, self.parallel, head=self.head, precision=self.precision, fp8=fp8, seed=seed)
        self.config = gpt.config  # TransformerConfig: the single source of model truth
        return gpt

    @staticmethod
    def freeze(gpt, trainable: str | None, adapters_only: bool = False) -> None:
        """trainable: None freezes everything, "" nothing, a prefix all but that prefix;
        adapters_only: of those, only the LoRA factors (models/lora.py). Must run before DDP and
        the optimizer see the parameters: both skip frozen ones, so they hold the adapters only."""
        from megarl.models.lora import is_adapter

        for pname, p in gpt.named_parameters():
            p.requires_grad_(trainable is not None and pname.startswith(trainable)
                             and (not adapters_only or is_adapter(pname)))

    def wrap(self, gpt, *, trained: bool):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.transformer.module import Float16Module

        module = Float16Module(self.config, gpt) if self.precision in ("bf16", "fp16") else gpt
        if not trained:
            return module
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False,
            use_distributed_optimizer=self.parallel.distributed_optimizer,
            fp8_param_gather=self.config.fp8_param)  # train.fp8.param_gather: all-gather FP8 weights
        return DistributedDataParallel(config=self.config, ddp_config=ddp_config, module=module)

    def attach_optimizer(self, optim: OptimConfig, schedule: LRScheduleConfig, train_steps: int) -> None:
        """train_steps counts optimizer steps (the LR schedule's length), not loop steps."""
        from megatron.core.distributed import finalize_model_grads

        self.config.finalize_model_grads_func = finalize_model_grads
        self.optimizer = build_optimizer(self.chunks, optim, precision=self.precision,
                                         distributed=self.parallel.distributed_optimizer)
        self.scheduler = build_scheduler(self.optimizer, optim, schedule, train_steps)
        if self.precision == "fp16":
            self.config.grad_scale_func = self.optimizer.scale_loss

    @property
    def model(self):
        return self.chunks[0]

    @property
    def trained(self) -> bool:
        return self.optimizer is not None

    # -- running micro-batches through megatron's schedule -----------------------------------

    def _schedule(self, microbatches: list[Batch], on_output: Callable, *, forward_only: bool, collect: bool):
        """One call of megatron's forward-backward schedule over `microbatches`.

        Each micro-batch is a fixed [b, s]; different calls, and different micro-batches of one
        call, may have different shapes (variable_seq_lengths makes pipeline stages exchange
        shapes first, which PP>1 needs only then). `on_output(batch, output)` is the loss
        function (training/eval) or the collect function (collect=True).
        """
        from megatron.core.pipeline_parallel import get_forward_backward_func

        if not microbatches:
            raise ValueError(f"role {self.name}: no micro-batches")

        # bf16/fp16 LM logits stay in their dtype (Float16Module would otherwise make an fp32 copy
        # of the whole [b, s, V] tensor): the fused log-prob op reads them as they are
        kwargs = {"fp32_output": False} if self.precision in ("bf16", "fp16") and self.head == "lm" else {}

        dev = device()

        def forward_step(data_iterator, model):
            batch = next(data_iterator).to(dev)  # data stays on the host until its turn
            output = model(batch.tokens, batch.position_ids, batch.attention_mask, **kwargs, **batch.model_kwargs())
            if collect:
                return output, lambda out, non_loss_data=True: on_output(batch, out)
            return output, lambda out: on_output(batch, out)

        microbatches = [MicroBatch.of(mb) for mb in microbatches]
        shapes = {mb.shape for mb in microbatches}
        b, s = microbatches[0].shape
        self.config.variable_seq_lengths = len(shapes) > 1
        if self.optimizer is None and not forward_only:
            raise RuntimeError(f"role {self.name} is frozen: it has no optimizer to train with")
        for c in self.chunks:
            c.train(not forward_only and not collect)
        with torch.set_grad_enabled(not forward_only):
            return get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iter(microbatches), model=self.chunks,
                num_microbatches=len(microbatches), seq_length=s, micro_batch_size=b,
                forward_only=forward_only, collect_non_loss_data=collect)

    def forward_backward(self, microbatches: list[Batch], loss_fn: LossFn, *, forward_only: bool = False) -> dict:
        """Run every micro-batch through the pipeline; returns reduced metrics (all ranks).

        Without forward_only the gradients accumulate in the buffers (`accumulating` is set)
        until `train_step` applies them."""
        reported = self._schedule(microbatches, loss_fn, forward_only=forward_only, collect=False)
        if not forward_only:
            self.accumulating = True
        return reduce_metrics(reported)

    def train_step(self, microbatches: list[Batch], loss_fn: LossFn, *, skip_nonfinite: bool = False) -> StepResult:
        """One optimizer step over a global batch split into this DP rank's micro-batches.

        skip_nonfinite: when the reduced loss is NaN/inf (identical on every rank), drop the
        gradients and skip the optimizer step instead of applying them (reported as skipped)."""
        if self.optimizer is None:
            raise RuntimeError(f"role {self.name} was built without an optimizer")
        for c in self.chunks:
            c.zero_grad_buffer()
        self.optimizer.zero_grad()
        metrics = self.forward_backward(microbatches, loss_fn)
        if skip_nonfinite and not math.isfinite(metrics.get("loss", 0.0)):
            for c in self.chunks:
                c.zero_grad_buffer()
            self.accumulating = False
            return StepResult(metrics, float("nan"), self.optimizer.param_groups[0]["lr"], True)
        ok, grad_norm, _ = self.optimizer.step()
        self.accumulating = False
        lr = self.optimizer.param_groups[0]["lr"]
        if ok:
            self.scheduler.step(increment=1)
        return StepResult(metrics, float(grad_norm) if grad_norm is not None else float("nan"), lr, not ok)

    @torch.no_grad()
    def evaluate(self, microbatches: list[Batch], loss_fn: LossFn) -> dict:
        return self.forward_backward(microbatches, loss_fn, forward_only=True)

    @torch.no_grad()
    def forward_collect(self, microbatches: list[Batch], collect: Callable[[Batch, torch.Tensor], object]) -> list:
        """Forward only (eval mode); `collect(batch, output)` runs on the last stage for each
        micro-batch and returns tensors (e.g. per-token log-probs or values [b, s]) or small
        objects; the list of results reaches every rank of the pipeline, tensors as tensors."""
        from megatron.core import parallel_state as ps

        results = self._schedule(microbatches, collect, forward_only=True, collect=True)
        return list(broadcast_from_last_stage(list(results) if ps.is_pipeline_last_stage() else None))

    # -- time-sharing the device (megarl.roles.offload) -------------------------------------

    def offload(self, params: bool = True, grads: bool = True, optimizer: bool = True) -> dict:
        """Move these kinds of state to host memory (bit-exact on onload); returns residency."""
        from megarl.roles import offload
        return offload.offload(self, params=params, grads=grads, optimizer=optimizer)

    def onload(self, params: bool = True, grads: bool = True, optimizer: bool = True) -> dict:
        from megarl.roles import offload
        return offload.onload(self, params=params, grads=grads, optimizer=optimizer)

    @property
    def residency(self) -> dict:
        """kind -> {"device": bytes, "host": bytes}."""
        from megarl.roles import offload
        return offload.residency(self)


def reduce_metrics(reported: list[dict]) -> dict:
    """Per-microbatch {name: [sum, count]} on the last stage -> global means on every rank."""
    from megatron.core import parallel_state as ps

    totals: dict[str, torch.Tensor] = {}
    for mb in reported or []:
        for k, v in mb.items():
            v = v.detach().double().cpu()
            totals[k] = totals[k] + v if k in totals else v
    means = dp_means({k: (v[0], v[1]) for k, v in totals.items()}) if ps.is_pipeline_last_stage() else {}
    return broadcast_from_last_stage(means)
