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
    optimizer = get_megatron_optimizer(config, model_chunks)
    if distributed:
        fix_distributed_torch_adam(optimizer)
    from megarl.optim.foreach import with_foreach_clip

    return with_foreach_clip(optimizer)  # without apex/TE: foreach grad norm/clip, fused torch AdamW


def fix_distributed_torch_adam(optimizer) -> None:
    """Make megatron-core 0.16's DistributedOptimizer over torch's Adam checkpointable.

    Without Transformer Engine or apex (always on CPU) megatron-core runs the distributed
    optimizer over `torch.optim.AdamW`, whose per-parameter state holds `step`; fused Adam keeps
    it in the param groups. Three places of megatron-core 0.16 miss that (distrib_optimizer.py):
    1. `state_dict()` asserts exactly one step among the per-parameter states, which torch
       creates lazily: before the first step there is none, so neither a save nor a load (which
       calls `state_dict()` first) works. Fix: allocate torch's own first-step state here (step
       0, zero moments; `Adam._init_group` then keeps it, so training is unchanged).
    2. `_set_main_param_and_optimizer_states` copies every key of the live state from the
       loaded tensors, which never carry `step` (the fully reshardable loader skips it):
       KeyError. Fix: leave `step` out of that copy; `load_state_dict` sets it from the groups.
    3. `load_state_dict` gives every parameter the *same* step tensor, which torch's Adam then
       increments once per parameter (2 steps after a load of 39 tensors: step 80, not 4, and
       a wrong bias correction). Fix: each parameter gets its own copy.
    Only DistributedOptimizers over torch Adam are touched (instance attributes, nothing global).
    """
    import torch
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if isinstance(opt, DistributedOptimizer) and isinstance(opt.optimizer, torch.optim.Adam):
            _init_adam_state(opt.optimizer)
            opt._set_main_param_and_optimizer_states = _without_step(opt, opt._set_main_param_and_optimizer_states)
            opt.load_state_dict = _unaliased_steps(opt, opt.load_state_dict)


def _init_adam_state(adam) -> None:
    """The state `torch.optim.Adam._init_group` creates on a parameter's first step."""
    import torch
    from torch.optim.optimizer import _get_scalar_dtype

    for group in adam.param_groups:
        on_device = group.get("capturable") or group.get("fused")
        for p in group["params"]:
            state = adam.state[p]
            if state:
                continue
            state["step"] = (torch.zeros((), dtype=_get_scalar_dtype(is_fused=group.get("fused")), device=p.device)
                             if on_device else torch.tensor(0.0, dtype=_get_scalar_dtype()))
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if group.get("amsgrad"):
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def _without_step(opt, set_states):
    def set_main_param_and_optimizer_states(model_param, tensors):
        group_index, group_order = opt.model_param_group_index_map[model_param]
        state = opt.optimizer.state[opt.optimizer.param_groups[group_index]["params"][group_order]]
        step = state.pop("step") if "step" in state and "step" not in tensors else None
        try:
            set_states(model_param, tensors)
        finally:
            if step is not None:
                state["step"] = step
    return set_main_param_and_optimizer_states


def _unaliased_steps(opt, load_state_dict):
    def load(state_dict):
        load_state_dict(state_dict)
        for state in opt.optimizer.state.values():
            if "step" in state:
                state["step"] = state["step"].clone()
    return load


def build_scheduler(optimizer, o: OptimConfig, s: LRScheduleConfig, train_steps: int):
    """Megatron's OptimizerParamScheduler, stepping once per optimizer step.

    'constant' keeps lr after warmup; 'linear' and 'cosine' decay to min_lr at decay_steps
    (counted from step 0, warmup included, as in Megatron-LM); 'wsd' holds lr until the last
    wsd_decay_steps before decay_steps, then decays linearly to min_lr (Megatron's WSD).
    """
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    decay_steps = s.decay_steps if s.decay_steps is not None else train_steps
    wsd = {}
    if s.style == "wsd":
        anneal = s.wsd_decay_steps or max(1, (decay_steps - s.warmup_steps) // 5)
        wsd = {"wsd_decay_steps": anneal, "lr_wsd_decay_style": "linear"}
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if s.warmup_steps > 0 else o.lr,
        max_lr=o.lr,
        min_lr=o.min_lr,
        lr_warmup_steps=s.warmup_steps,
        lr_decay_steps=max(decay_steps, s.warmup_steps + 1),
        lr_decay_style="WSD" if s.style == "wsd" else s.style,
        start_wd=o.weight_decay,
        end_wd=o.weight_decay,
        wd_incr_steps=max(train_steps, 1),
        wd_incr_style="constant",
        **wsd,
    )
