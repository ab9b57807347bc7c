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

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from megarl.config.schema import LRScheduleConfig, ModelConfig, OptimConfig, ParallelConfig
from megarl.models.gpt import build_model
from megarl.optim import build_optimizer, build_scheduler

Batch = dict  # tokens [b, s], position_ids [b, s], attention_mask [b, 1, s, s] or None, ...
LossFn = Callable[[Batch, torch.Tensor], tuple]


@dataclass
class StepResult:
    metrics: dict  # name -> global mean over the step's batch (identical on every rank)
    grad_norm: float
    lr: float
    skipped: bool  # fp16 overflow: the optimizer skipped this step


class Role:
    def __init__(self, name: str, model_cfg: ModelConfig, parallel: ParallelConfig, *,
                 head: str = "lm", precision: str = "fp32", fp8: str | None = None, seed: int = 1234,
                 optim: OptimConfig | None = None, schedule: LRScheduleConfig | None = None,
                 train_steps: int = 1, train_only_head: bool = False):
        from megatron.core.distributed import (
            DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads,
        )
        from megatron.core.transformer.module import Float16Module

        self.name, self.model_cfg, self.head = name, model_cfg, head
        gpt = build_model(model_cfg, parallel, head=head, precision=precision, fp8=fp8, seed=seed)
        self.config = gpt.config  # TransformerConfig: the single source of model truth
        if train_only_head:  # frozen before DDP and the optimizer see the parameters
            for pname, p in gpt.named_parameters():
                p.requires_grad_(pname.startswith("output_layer."))
        module = Float16Module(self.config, gpt) if precision in ("bf16", "fp16") else gpt
        self.optimizer = self.scheduler = None
        if optim is not None:
            ddp_config = DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                use_distributed_optimizer=parallel.distributed_optimizer)
            module = DistributedDataParallel(config=self.config, ddp_config=ddp_config, module=module)
            self.config.finalize_model_grads_func = finalize_model_grads
            self.optimizer = build_optimizer([module], optim, precision=precision,
                                             distributed=parallel.distributed_optimizer)
            self.scheduler = build_scheduler(self.optimizer, optim, schedule or LRScheduleConfig(), train_steps)
            if precision == "fp16":
                self.config.grad_scale_func = self.optimizer.scale_loss
        else:
            for p in module.parameters():
                p.requires_grad_(False)
        self.chunks = [module]  # one chunk per virtual pipeline stage (one today)

    @property
    def model(self):
        return self.chunks[0]

    # ----------------------------------------------------------------------------------

    def forward_backward(self, microbatches: list[Batch], loss_fn: LossFn, *, forward_only: bool = False) -> dict:
        """Run every microbatch through the pipeline; returns reduced metrics (all ranks)."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data_iterator, model):
            batch = next(data_iterator)
            output = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"))
            return output, lambda out: loss_fn(batch, out)

        b, s = microbatches[0]["tokens"].shape
        for c in self.chunks:
            c.train(not forward_only)
        with torch.set_grad_enabled(not forward_only):
            reported = get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iter(microbatches), model=self.chunks,
                num_microbatches=len(microbatches), seq_length=s, micro_batch_size=b,
                forward_only=forward_only)
        return reduce_metrics(reported)

    def train_step(self, microbatches: list[Batch], loss_fn: LossFn) -> StepResult:
        """One optimizer step over a global batch split into this DP rank's microbatches."""
        assert self.optimizer is not None, f"role {self.name} was built without an optimizer"
        for c in self.chunks:
            c.zero_grad_buffer()
        self.optimizer.zero_grad()
        metrics = self.forward_backward(microbatches, loss_fn)
        ok, grad_norm, _ = self.optimizer.step()
        lr = self.optimizer.param_groups[0]["lr"]
        if ok:
            self.scheduler.step(increment=1)
        return StepResult(metrics, float(grad_norm) if grad_norm is not None else float("nan"), lr, not ok)

    @torch.no_grad()
    def evaluate(self, microbatches: list[Batch], loss_fn: LossFn) -> dict:
        return self.forward_backward(microbatches, loss_fn, forward_only=True)

    @torch.no_grad()
    def forward_collect(self, microbatches: list[Batch], collect: Callable[[Batch, torch.Tensor], object]) -> list:
        """Forward only; `collect(batch, output)` runs on the last stage for each microbatch
        (keep its result small: argmax ids, values at a few positions) and the list of results
        reaches every rank of the pipeline."""
        from megatron.core import parallel_state as ps
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data_iterator, model):
            batch = next(data_iterator)
            output = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"))
            return output, lambda out, non_loss_data=True: collect(batch, out)

        b, s = microbatches[0]["tokens"].shape
        for c in self.chunks:
            c.eval()
        results = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(microbatches), model=self.chunks,
            num_microbatches=len(microbatches), seq_length=s, micro_batch_size=b,
            forward_only=True, collect_non_loss_data=True)
        if dist.is_initialized() and ps.get_pipeline_model_parallel_world_size() > 1:
            box = [results if ps.is_pipeline_last_stage() else None]
            dist.broadcast_object_list(box, src=ps.get_pipeline_model_parallel_last_rank(),
                                       group=ps.get_pipeline_model_parallel_group())
            results = box[0]
        return list(results)


def reduce_metrics(reported: list[dict]) -> dict:
    """Per-microbatch {name: [sum, count]} on the last stage -> global means on every rank."""
    from megatron.core import parallel_state as ps

    totals: dict[str, torch.Tensor] = {}
    for mb in reported or []:
        for k, v in mb.items():
            v = v.detach().double().cpu()
            totals[k] = totals[k] + v if k in totals else v
    dp_group = ps.get_data_parallel_group(with_context_parallel=True)
    if ps.is_pipeline_last_stage() and totals:
        packed = torch.stack([totals[k] for k in sorted(totals)])
        if dist.is_initialized():
            packed = packed.to(_collective_device())
            dist.all_reduce(packed, group=dp_group)
            packed = packed.cpu()
        means = {k: (packed[i, 0] / packed[i, 1].clamp(min=1)).item() for i, k in enumerate(sorted(totals))}
    else:
        means = {}
    if dist.is_initialized() and ps.get_pipeline_model_parallel_world_size() > 1:
        box = [means]
        dist.broadcast_object_list(box, src=ps.get_pipeline_model_parallel_last_rank(),
                                   group=ps.get_pipeline_model_parallel_group())
        means = box[0]
    return means


def _collective_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
