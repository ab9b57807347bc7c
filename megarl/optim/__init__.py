"""megatron-core's optimizer stack and LR schedules, configured from `OptimConfig`.

AdamW with decoupled weight decay (not on biases and norms), global-norm gradient clipping
across every parallel rank, fp32 main parameters for bf16/fp16 models, and the distributed
optimizer when asked. Nothing here re-implements an optimizer.
"""
from __future__ import annotations

from megarl.config.schema import LRScheduleConfig, OptimConfig


def build_optimizer(model_chunks: list, o: OptimConfig, *, precision: str = "fp32",
                    distributed: bool = False):
    """A MegatronOptimizer over DDP-wrapped model chunks."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megarl.models.gpt import DTYPES

    config = OptimizerConfig(
        optimizer="adam",  # megatron-core's "adam" is AdamW (decoupled weight decay)
        lr=o.lr,
        min_lr=o.min_lr,
        weight_decay=o.weight_decay,
        adam_beta1=o.beta1,
        adam_beta2=o.beta2,
        adam_eps=o.eps,
        clip_grad=o.clip_grad,
        bf16=precision == "bf16",
        fp16=precision == "fp16",
        params_dtype=DTYPES[precision],
        use_distributed_optimizer=distributed,
        loss_scale=None,  # dynamic loss scaling for fp16
        initial_loss_scale=2.0**16 if precision == "fp16" else None,
    )
    return get_megatron_optimizer(config, model_chunks)


def build_scheduler(optimizer, o: OptimConfig, s: LRScheduleConfig, train_steps: int):
    """Megatron's OptimizerParamScheduler, stepping once per optimizer step.

    'constant' keeps lr after warmup; 'linear' and 'cosine' decay to min_lr at decay_steps
    (counted from step 0, warmup included, as in Megatron-LM).
    """
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    decay_steps = s.decay_steps if s.decay_steps is not None else train_steps
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if s.warmup_steps > 0 else o.lr,
        max_lr=o.lr,
        min_lr=o.min_lr,
        lr_warmup_steps=s.warmup_steps,
        lr_decay_steps=max(decay_steps, s.warmup_steps + 1),
        lr_decay_style=s.style,
        start_wd=o.weight_decay,
        end_wd=o.weight_decay,
        wd_incr_steps=max(train_steps, 1),
        wd_incr_style="constant",
    )
