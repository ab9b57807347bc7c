"""Step speed: megarl vs Hugging Face transformers on the same Llama weights (issue 18).

    python bench/bench_step.py [--quick] [--reps 7] [--threads 2] [--shapes big,small]
    python bench/bench_step.py --gpu [--layers 4] [--seq 4096] [--batch 1]   # on an H100

A random Llama is built with transformers (sdpa attention, fp32 on CPU), saved, and imported
into megarl with `megarl.checkpoint.hf`, so both sides hold identical weights. One process
(world size 1, gloo on CPU) runs, interleaved rep by rep so that load from other processes
hits every variant alike:
  train   one optimizer step: forward + backward of the mean next-token NLL + AdamW with
          global-norm clip 1.0 (megarl: Role.train_step with the fused log-prob op; HF: a plain
          loop, cross_entropy + clip_grad_norm_ + torch.optim.AdamW)
  forward forward only, no grad (megarl: Role.forward_collect; HF: model(...).logits)
  score   per-token log-probs of given tokens, as RL's reference / old-policy pass
          (megarl: megarl.ops.logprobs_and_entropy on the vocab-parallel logits; HF:
          log_softmax(logits.float()).gather)
Prints best and median wall time of each, megarl/HF ratios, and the agreement of logits,
first-step loss and scored log-probs. --gpu: bf16 on CUDA at a Llama-3.1-8B layer shape
(hidden 4096, ffn 14336, 32/8 heads, vocab 128256), tokens/s and MFU of both (untested here).
"""
import argparse
import os
import resource
import statistics
import sys
import tempfile
import time
import warnings

warnings.filterwarnings("ignore")  # megatron-core's "apex is not installed" and the like
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# name -> (hidden, layers, heads, kv heads, ffn, vocab, batch, seq): the two shapes
SHAPES = {
    "big": (512, 8, 8, 8, 1408, 32000, 8, 128),
    "small": (128, 4, 4, 4, 352, 32000, 8, 64),
}
H100_BF16_PEAK = 989e12  # dense bf16 FLOP/s, H100 SXM


def build_models(shape, device, dtype, ablate=(), seed=0):
    """(HF model, {side: megarl Role}, ModelConfig), all holding the same random weights.

    Sides: "megarl", plus the ablations asked for: "megarl:copy" runs megatron-core's own
    GPTModel forward (logits copied to [b, s, V]), "megarl:mcore-step" megatron-core's own
    optimizer step (per-tensor grad-norm / clip fallbacks, per-op torch AdamW) instead of
    megarl's (foreach norm and clip, fused AdamW: megarl.optim.foreach)."""
    import torch
    import transformers
    from megatron.core.models.gpt import GPTModel

    from megarl.checkpoint.hf import load_hf_checkpoint
    from megarl.config import LRScheduleConfig, OptimConfig, ParallelConfig
    from megarl.models.layout import load_full_state_dict, unwrap
    from megarl.roles.role import Role

    hidden, layers, heads, kv, ffn, vocab, _, seq = shape
    cfg = transformers.LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                                   num_key_value_heads=kv, intermediate_size=ffn, vocab_size=vocab,
                                   max_position_embeddings=max(seq, 128), rms_norm_eps=1e-5,
                                   tie_word_embeddings=False)
    torch.manual_seed(seed)
    hf = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():  # weights away from init, like a trained model's
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if name.endswith("norm.weight") else 0.02 * torch.randn_like(p))
    roles = {}
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d, safe_serialization=True)
        mc, canonical = load_hf_checkpoint(d)
        precision = "bf16" if dtype == torch.bfloat16 else "fp32"
        optim = OptimConfig(lr=1e-5, weight_decay=0.0, clip_grad=1.0, beta2=0.999)
        for side in ("megarl", *ablate):
            role = Role("policy", mc, ParallelConfig(), head="lm", precision=precision, optim=optim,
                        schedule=LRScheduleConfig(style="constant"), train_steps=10**6)
            load_full_state_dict(role.model, canonical, mc.vocab_size)
            if side == "megarl:copy":
                unwrap(role.model).__class__ = GPTModel
            elif side == "megarl:mcore-step":
                role.optimizer = role.scheduler.optimizer = role.optimizer.inner
            roles[side] = role
    hf = hf.to(device=device, dtype=dtype)
    hf.config._attn_implementation = "sdpa"
    return hf, roles, mc


def make_batch(shape, vocab, device, seed=1):
    import torch

    *_, b, s = shape
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, vocab, (b, s + 1), generator=g)
    return {"tokens": seq[:, :-1].to(device), "labels": seq[:, 1:].to(device),
            "position_ids": torch.arange(s).expand(b, s).to(device), "attention_mask": None,
            "loss_mask": torch.ones(b, s, device=device)}


def megarl_fns(role, mc, batch, sync):
    """mode -> fn running one measurement on a megarl Role."""
    from megarl.algorithms.losses import masked_nll
    from megarl.trainers.common import token_logprobs

    V = mc.vocab_size

    def loss_fn(b, logits):
        return masked_nll(token_logprobs(logits, b["labels"], V), b["loss_mask"])

    def train():
        r = role.train_step([batch], loss_fn)
        sync()
        return r.metrics["loss"]

    def forward():
        out = role.forward_collect([batch], lambda b, logits: logits.shape)
        sync()
        return out

    def score():
        (lp,) = role.forward_collect([batch], lambda b, logits: token_logprobs(logits, b["labels"], V))
        sync()
        return lp

    return {"train": train, "forward": forward, "score": score}


def hf_fns(hf, batch, sync):
    """mode -> fn running one measurement on the transformers model (a plain training loop)."""
    import torch
    import torch.nn.functional as F

    opt = torch.optim.AdamW(hf.parameters(), lr=1e-5, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)

    def train():
        logits = hf(input_ids=batch["tokens"]).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        return loss.item()

    @torch.no_grad()
    def forward():
        out = hf(input_ids=batch["tokens"]).logits
        sync()
        return out.shape

    @torch.no_grad()
    def score():
        logits = hf(input_ids=batch["tokens"]).logits
        lp = torch.log_softmax(logits.float(), -1).gather(-1, batch["labels"][..., None]).squeeze(-1)
        sync()
        return lp

    return {"train": train, "forward": forward, "score": score}


def agreement(hf, role, mc, batch):
    """max |logit diff|, max |log-prob diff| at the current (identical) weights."""
    import torch

    from megarl.trainers.common import token_logprobs

    with torch.no_grad():
        ref = hf(input_ids=batch["tokens"]).logits.float()
        ref_lp = torch.log_softmax(ref, -1).gather(-1, batch["labels"][..., None]).squeeze(-1)
    (got,) = role.forward_collect([batch], lambda b, logits: logits[..., :mc.vocab_size].float().clone())
    (lp,) = role.forward_collect([batch], lambda b, logits: token_logprobs(logits, b["labels"], mc.vocab_size))
    return (got - ref).abs().max().item(), (lp - ref_lp).abs().max().item()


def timed(fn):
    """(wall s, CPU s of all threads, minor page faults): CPU time is the steadier figure on a
    loaded machine; page faults count first touches of fresh memory (the allocator's share)."""
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    w0, c0 = time.perf_counter(), time.process_time()
    fn()
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    return wall, cpu, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0


def run_shape(name, shape, reps, device, dtype, modes, ablate):
    """Rows (shape, mode, side, walls, CPU times, page faults, tokens) after the agreement checks."""
    import torch

    hf, roles, mc = build_models(shape, device, dtype, ablate)
    batch = make_batch(shape, mc.vocab_size, device)
    logit_diff, lp_diff = agreement(hf, roles["megarl"], mc, batch)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fns = {side: megarl_fns(role, mc, batch, sync) for side, role in roles.items()}
    fns["hf"] = hf_fns(hf, batch, sync)
    losses = {side: f["train"]() for side, f in fns.items()}  # first step, same weights everywhere
    for f in fns.values():  # one more warm-up each
        for mode in modes:
            f[mode]()
    sides = list(fns)
    times = {(mode, side): [] for mode in modes for side in sides}
    for rep in range(reps):  # interleaved, and the order rotates so no side always goes first
        for mode in modes:
            for side in sides[rep % len(sides):] + sides[:rep % len(sides)]:
                times[(mode, side)].append(timed(fns[side][mode]))
    print(f"[{name}] max |logit diff| {logit_diff:.2e}, max |log-prob diff| {lp_diff:.2e}, first-step loss "
          + ", ".join(f"{side} {v:.6f}" for side, v in losses.items())
          + f" (|megarl - hf| {abs(losses['megarl'] - losses['hf']):.1e})", flush=True)
    *_, b, s = shape
    return [(name, mode, side, *zip(*times[(mode, side)]), b * s) for mode in modes for side in sides], mc


def model_flops_per_token(mc, seq, train):
    """Matmul FLOPs per token (Megatron's accounting: causal attention counted in full)."""
    h, L, f, V = mc.hidden_size, mc.num_layers, mc.ffn_hidden_size, mc.vocab_size
    kvh = mc.num_kv_heads or mc.num_attention_heads
    d = mc.head_dim or h // mc.num_attention_heads
    per_layer = 2 * h * (mc.num_attention_heads * d + 2 * kvh * d) + 2 * mc.num_attention_heads * d * h \
        + 2 * 3 * h * f + 2 * 2 * seq * mc.num_attention_heads * d
    fwd = L * per_layer + 2 * h * V
    return 3 * fwd if train else fwd


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="3 reps, the small shape and train+score only")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shapes", default="big,small")
    ap.add_argument("--modes", default="train,forward,score")
    ap.add_argument("--ablate", action="store_true",
                    help="also time megarl with megatron's logits copy and with megatron's own optimizer step")
    ap.add_argument("--gpu", action="store_true", help="bf16 on CUDA at a Llama-3.1-8B layer shape")
    ap.add_argument("--layers", type=int, default=4, help="--gpu: decoder layers of the 8B shape")
    ap.add_argument("--seq", type=int, default=4096, help="--gpu: sequence length")
    ap.add_argument("--batch", type=int, default=1, help="--gpu: sequences per step")
    args = ap.parse_args()

    import torch
    import transformers

    from megarl.runtime.distributed import init_distributed, teardown

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    reps, modes = args.reps, args.modes.split(",")
    ablate = ("megarl:copy", "megarl:mcore-step") if args.ablate else ()
    shapes = {k: SHAPES[k] for k in args.shapes.split(",")}
    if args.quick:
        reps, modes, shapes = 3, ["train", "score"], {"small": SHAPES["small"]}
    if args.gpu:
        if not torch.cuda.is_available():
            sys.exit("bench_step.py --gpu: no CUDA device")
        device, dtype = torch.device("cuda"), torch.bfloat16
        shapes = {"llama8b-layer": (4096, args.layers, 32, 8, 14336, 128256, args.batch, args.seq)}
    else:
        device, dtype = torch.device("cpu"), torch.float32
        torch.set_num_threads(args.threads)
    init_distributed(1, 1, seed=0)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{'CUDA ' + torch.cuda.get_device_name() if args.gpu else f'CPU, {torch.get_num_threads()} threads'}, "
          f"{reps} interleaved reps, load average at start {load:.2f}", flush=True)
    rows = []
    for name, shape in shapes.items():
        r, mc = run_shape(name, shape, reps, device, dtype, modes, ablate)
        rows += [(*x, mc) for x in r]
    print("\n| shape | measurement | side | wall best / median (ms) | / HF wall, best | / HF wall, median "
          "| CPU time best (ms) | / HF CPU time, best | page faults / call |"
          + (" tokens/s | MFU |" if args.gpu else ""))
    print("|---|---|---|---|---|---|---|---|---|" + ("---|---|" if args.gpu else ""))
    hf_row = {(r[0], r[1]): r for r in rows if r[2] == "hf"}
    for name, mode, side, wall, cpu, faults, tokens, mc in rows:
        _, _, _, hwall, hcpu, _, _, _ = hf_row[(name, mode)]
        line = (f"| {name} | {mode} | {side} | {min(wall) * 1e3:.1f} / {statistics.median(wall) * 1e3:.1f} "
                f"| {min(wall) / min(hwall):.3f}x | {statistics.median(wall) / statistics.median(hwall):.3f}x "
                f"| {min(cpu) * 1e3:.1f} | {min(cpu) / min(hcpu):.3f}x | {statistics.median(faults):,.0f} |")
        if args.gpu:
            flops = model_flops_per_token(mc, args.seq, mode == "train") * tokens
            line += f" {tokens / min(wall):,.0f} | {flops / min(wall) / H100_BF16_PEAK:.1%} |"
        print(line)
    print(f"load average at end {os.getloadavg()[0]:.2f}")
    teardown()


if __name__ == "__main__":
    main()
