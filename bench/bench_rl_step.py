"""CPU benchmark: seconds per GRPO step, megarl's RLStage vs TRL's GRPOTrainer, same model and batch.

    python bench/bench_rl_step.py [--quick] [--steps 3] [--threads 1] [--hidden 512] [--ffn 1408]
                                  [--layers 8] [--heads 8] [--kv-heads 8] [--vocab 32000]
                                  [--prompts 8] [--samples 8] [--prompt-len 32] [--new-tokens 128]
                                  [--micro-batch 8] [--beta 0.04] [--old-logprobs rollout|recompute]
                                  [--no-trl] [--profile] [--workload default|realistic]
                                  [--precision fp32|bf16] [--mean-len 200]

One random Llama is built with transformers (default init, seeded) and saved with a 32k-word
WordLevel tokenizer (ids are words "w<id>"; its chat template renders the bare prompt, so both
frameworks feed identical prompt ids). megarl imports it (roles.actor/reference.init_from = the
directory) and runs `RLStage.step` in this process; TRL runs `GRPOTrainer` on the same directory
in a subprocess of its own venv (bench/.venv-trl, created on first use with `python -m venv`, no
system site-packages, + `pip install torch==<this process's torch version> trl ...`: both sides
run the same torch; reused afterwards while its torch still matches). TRL runs without gradient
checkpointing (its default recomputes every layer's forward in the backward; megarl does not).

--workload realistic: shaped like real RL instead of the kind default shape: prompts of 40..200
tokens (uniform per prompt) shared by `samples` samples, response lengths long-tailed up to
--new-tokens (default 1024) ending with EOS, a 151,936-word vocabulary at hidden 256 (4 layers).
The random model gets an "EOS channel" so that both frameworks stop the same way: one residual
dimension holds a constant (embeddings set it, no attention/MLP output writes it), and only the
EOS row of the LM head reads it, giving EOS a logit of about log(V / --mean-len) at every step
(geometric-like lengths, mean ~ --mean-len, spread further by the other dimensions' noise).

Both: `prompts` x `samples` rows, `new-tokens` sampled tokens at temperature 1, one PPO epoch, one
optimizer step over micro-batches of `micro-batch` rows, KL-to-reference loss term (k3) with
coefficient `beta`, fp32 (or --precision bf16: megarl `train.precision=bf16`, bf16 weights with fp32
main weights and gradient buffers in the optimizer, its bf16 GEMMs run as `--cpu-half-gemm` says;
TRL loads the model in bf16 with `bf16=True`),
the same rule reward (fraction of response words whose id ends in 7).
No evaluation, logging or checkpointing happens inside a step (megarl: `step()` only; TRL:
logging/save/eval strategies "no", report_to none). One warm-up step each, then `steps` timed
steps, interleaved megarl, TRL, megarl, ... (TRL's worker blocks between steps in a callback, so
the two never run at once). Reported: best and median wall seconds per step and CPU seconds
(user+sys of the process, all threads: less sensitive to other load on a shared machine), and
each one's phase breakdown: megarl's `perf/<phase>_s`; TRL's from timers wrapped around its
`_generate`, `_get_per_token_logps_and_entropies` (reference), `_calculate_rewards` and
`_generate_and_score_completions` (train = the rest of the step).
--profile prints torch.profiler's top ops for one more megarl step.
The GEMM floor of the necessary work counts the prompt once per prompt in generation and once
per sample in scoring and training (padded rows, as megarl scores and trains them).
Its GEMM rates are measured right after each timed megarl step (fp32), and each step is compared
with the floor measured beside it: on a shared VM the machine's speed moves by 10-15% within
minutes, and a floor measured once, minutes after the steps, moved megarl's ratio more than that
(docs/benchmarks.md, "RL step vs TRL (CPU)"). The summary floor takes each GEMM's median rate over
those measurements, and the spread of the floor across them is printed.
"""
import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VENV = os.path.join(ROOT, "bench", ".venv-trl")
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"  # the bare prompt, both frameworks


def reward(prompts, completions, *args, **kwargs):
    """Rule reward shared by both frameworks: the fraction of response words whose id ends in 7
    (about 0.1 for a random policy, varying within a group, so GRPO's advantages are not all 0)."""
    out = []
    for text in completions:
        words = text.split()
        out.append(sum(w.endswith("7") for w in words) / max(len(words), 1))
    return out


# ---------------------------------------------------------------------------------------------
# The shared model, tokenizer and prompts


def build_assets(args, out: str) -> tuple[str, str]:
    """A random transformers Llama + WordLevel tokenizer in out/model, prompts in out/prompts.jsonl."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    model_dir = os.path.join(out, "model")
    words = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"w{i}": i for i in range(3, args.vocab)}}
    tk = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.add_special_tokens(["<pad>", "<eos>", "<unk>"])
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>", pad_token="<pad>",
                                                  unk_token="<unk>")
    hf_tok.chat_template = CHAT_TEMPLATE
    hf_tok.save_pretrained(model_dir)

    config = transformers.LlamaConfig(
        hidden_size=args.hidden, intermediate_size=args.ffn, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, vocab_size=args.vocab,
        max_position_embeddings=args.max_pos, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    if args.workload == "realistic":
        add_eos_channel(model, args)
    model.save_pretrained(model_dir, safe_serialization=True)

    rng = random.Random(0)
    prompts_file = os.path.join(out, "prompts.jsonl")
    with open(prompts_file, "w") as f:
        for _ in range(8 * args.prompts):  # default: every prompt has exactly prompt_len tokens
            n = rng.randint(args.prompt_min, args.prompt_len)
            f.write(json.dumps({"prompt": " ".join(f"w{rng.randrange(3, args.vocab)}" for _ in range(n))}) + "\n")
    return model_dir, prompts_file


def add_eos_channel(model, args) -> None:
    """Make EOS (id 1) come with a hazard of about 1 / mean_len per token in a random Llama.

    Residual dimension k = hidden - 1 is 1.0 in every embedding and written by no attention or
    MLP output, so after the final RMSNorm it is positive at every position (its size set by the
    other dimensions' norm); only the EOS row of the LM head reads it, scaled so that the EOS
    logit averages log(V / (mean_len - 1)) over random token sequences (measured here)."""
    import math

    import torch

    k, eos = args.hidden - 1, 1
    with torch.no_grad():
        model.model.embed_tokens.weight[:, k] = 1.0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[k, :] = 0.0
            layer.mlp.down_proj.weight[k, :] = 0.0
        model.lm_head.weight[:, k] = 0.0
        model.lm_head.weight[eos, :] = 0.0
        ids = torch.randint(3, args.vocab, (4, 256), generator=torch.Generator().manual_seed(0))
        channel = model.model(ids).last_hidden_state[..., k].mean().item()  # after the final norm
        model.lm_head.weight[eos, k] = math.log(args.vocab / (args.mean_len - 1)) / channel


# ---------------------------------------------------------------------------------------------
# megarl, in this process


def build_megarl(args, model_dir: str, prompts_file: str, work: str):
    from megarl.config import load_config
    from megarl.runtime.distributed import init_distributed
    from megarl.trainers.rl import RLStage

    rows = args.prompts * args.samples
    overrides = [
        f"model.num_layers={args.layers}", f"model.hidden_size={args.hidden}", f"model.ffn_hidden_size={args.ffn}",
        f"model.num_attention_heads={args.heads}", f"model.num_kv_heads={args.kv_heads}",
        f"model.vocab_size={args.vocab}", f"model.max_position_embeddings={args.max_pos}",
        "model.rotary_base=10000", "model.norm_eps=1e-5", "model.tie_embeddings=false",
        "tokenizer.kind=hf", f"tokenizer.path={model_dir}",
        f"roles.actor.init_from={model_dir}", f"roles.reference.init_from={model_dir}",
        f"rl.prompts_path={prompts_file}", "rl.eval_prompts=0", "rl.eval_before_train=false",
        f"rl.prompts_per_step={args.prompts}", f"rl.samples_per_prompt={args.samples}",
        f"rl.max_prompt_len={args.prompt_len}", f"rl.max_new_tokens={args.new_tokens}", "rl.temperature=1.0",
        "rl.top_k=0", "rl.top_p=1.0", f"rl.rollout_batch_size={rows}",
        "rl.ppo_epochs=1", "rl.mini_batches=1", f"rl.micro_batch_size={args.micro_batch}",
        f"rl.kl_coef={args.beta}", "rl.kl_in=loss", "rl.kl_estimator=k3", "rl.clip_low=0.2", "rl.clip_high=0.2",
        "rl.loss_agg=token-mean", f"rl.reward_fn={os.path.abspath(__file__)}:reward",
        f"rl.old_logprobs={args.old_logprobs}",
        "optim.lr=1e-6", "optim.weight_decay=0.0", "optim.clip_grad=1.0", "lr_schedule.style=constant",
        f"train.precision={args.precision}",
        "train.seed=1", f"train.run_dir={work}", "tracking.backend=none",
        "checkpoint.save_interval=0"]
    cfg = load_config(os.path.join(ROOT, "megarl", "configs", "tiny_grpo.yaml"), overrides)
    init_distributed(1, 1, seed=cfg.train.seed)
    return RLStage(cfg, os.path.join(work, "rl"))


# --workload realistic: the model and lengths (prompts of 40..prompt_len tokens)
REALISTIC = dict(hidden=256, ffn=704, layers=4, heads=4, kv_heads=4, vocab=151936, prompt_len=200, new_tokens=1024)

PHASES = ("generate", "score_actor", "score_reference", "advantages", "train_actor")


def megarl_step(stage, step: int) -> dict:
    seen = []
    generate = stage.engine.generate
    stage.engine.generate = lambda *a, **k: seen.append(generate(*a, **k)) or seen[-1]  # keep the rollout
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        m = stage.step(step)
    finally:
        stage.engine.generate = generate
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    if m.get("train/skipped_steps"):
        raise RuntimeError(f"megarl skipped step {step}: {m}")
    return {"wall": wall, "cpu": cpu, "phases": {p: m.get(f"perf/{p}_s", 0.0) for p in PHASES},
            "response_len": m["rollout/response_len_mean"], "prompt_len": m["rollout/prompt_len_mean"],
            "reward": m["reward/mean"], "kl": m.get("kl/mean"),
            "response_lens": [int(n) for r in seen for n in r.response_lens]}


# ---------------------------------------------------------------------------------------------
# The GEMM floor of the work a step needs


def necessary_flops(args, prompt_len: float, response_len: float, shared: bool = False) -> dict:
    """GEMM FLOPs of the work one GRPO step needs, per (linear, GEMM kind), at the step's mean
    prompt and response lengths (linear layers' FLOPs are linear in the token count): the prompt
    prefilled once per prompt (not per sample), one decode step per response token (every
    layer + the LM head), the reference's forward and the actor's forward + backward over each
    row's prompt + response (shared=True: the prompt once per prompt), the LM head only on the
    response columns; no padding. Old log-probs come from the rollout (--old-logprobs rollout),
    so the actor scores nothing."""
    from bench_gemm_floor import linears

    rows = args.prompts * args.samples
    flops = {}
    for name, n, k in linears(args):
        per_token = 2 * n * k * (1 if name == "lm head" else args.layers)
        gen = (args.prompts * prompt_len + rows * response_len) if name != "lm head" else rows * response_len
        tok = rows * response_len + (0 if name == "lm head" else (args.prompts if shared else rows) * prompt_len)
        flops[(name, "decode fwd")] = per_token * gen
        flops[(name, "fwd")] = per_token * tok * 2  # reference scoring + training forward
        flops[(name, "dgrad")] = per_token * tok
        flops[(name, "wgrad")] = per_token * tok
    return flops


def gemm_rates(args, reps: int = 3) -> dict:
    """Best fp32 GFLOP/s per (linear, kind) at the step's shapes (4,096 tokens for training, one
    decode step's rows), in this process, of the fastest exact GEMM on the machine: MKL's sgemm
    (what `F.linear` runs, megarl's and TRL's CPU path) writing into an output allocated once, or
    oneDNN's fp32 inner product (`torch.ops.mkldnn._linear_pointwise`; not for grad(weight),
    which would need dy^T copied; bench_gemm_floor.py compares them). A fresh output per call is
    not counted: at the LM head's shape mapping and first-touching it is a cost of its own."""
    import torch
    from bench_gemm_floor import impls, linears, operands
    from timing import best_wall_and_cpu

    g = torch.Generator().manual_seed(0)
    rows = args.prompts * args.samples
    rates = {}
    for name, n, k in linears(args):
        for kind in ("fwd", "dgrad", "wgrad", "decode fwd"):
            x, w = operands(kind, rows if kind == "decode fwd" else 4096, n, k, torch.float32, g)
            libs = impls()  # fresh per GEMM: mm-fp32-out's output (2.5 GB for the head) goes with it
            candidates = [libs["mm-fp32-out"][1]]
            if "onednn-fp32" in libs and kind != "wgrad":  # wgrad: dy^T is a copy
                candidates.append(libs["onednn-fp32"][1])
            for fn in candidates:
                fn(x, w)  # warm-up (mm-fp32-out: allocates the output every rep reuses)
            best = min(best_wall_and_cpu(lambda: fn(x, w), reps)[0] for fn in candidates)
            rates[(name, kind)] = 2 * x.shape[0] * w.shape[0] * x.shape[1] / best / 1e9
            del libs, candidates
    return rates


def decode_seconds(args, reps: int = 3) -> dict:
    """Best seconds of each linear's forward at m = 1..rows live rows, {(linear, m): s}: a decode
    step with few rows is bound by reading the weight, so its time is measured, not derived from a
    FLOP rate. The fastest of the ways no engine need avoid: MKL's sgemm on the stored [n, k]
    weight as `x W^T` and as `(W x^T)^T` (2-3x faster at 2-4 rows of an LM head), MKL on the
    weight stored input-major ([k, n]: `x @ wt`) and oneDNN's inner product on that memory."""
    import torch
    import torch.nn.functional as F
    from bench_gemm_floor import linears
    from timing import best_wall_and_cpu

    onednn = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
    g = torch.Generator().manual_seed(0)
    seconds = {}
    for name, n, k in linears(args):
        w = torch.randn(n, k, generator=g)
        wt = w.t().contiguous()  # the same product with the weight stored input-major
        for m in range(1, args.prompts * args.samples + 1):
            x = torch.randn(m, k, generator=g)
            ways = [lambda: F.linear(x, w), lambda: torch.mm(w, x.t()).t(), lambda: x @ wt]
            if onednn is not None:
                ways.append(lambda: onednn(x, wt.t(), None, "none", [], ""))
            for fn in ways:
                fn()  # warm-up
            seconds[(name, m)] = min(best_wall_and_cpu(fn, reps)[0] for fn in ways)
    return seconds


def phase_floors(args, rates: dict, prompt_len: float, response_len: float, shared: bool = False) -> dict:
    """`necessary_flops` at `rates` as CPU-s per phase: generate (decode fwd), score_reference
    (one forward), train_actor (a forward, the input and the weight gradients) and the step."""
    flops = necessary_flops(args, prompt_len, response_len, shared)
    secs = {key: v / 1e9 / rates[key] for key, v in flops.items()}
    gen = sum(v for (_, kind), v in secs.items() if kind == "decode fwd")
    fwd = sum(v for (_, kind), v in secs.items() if kind == "fwd") / 2  # the reference's half
    grads = sum(v for (_, kind), v in secs.items() if kind in ("dgrad", "wgrad"))
    return {"generate": gen, "score_reference": fwd, "train_actor": fwd + grads, "step": sum(secs.values())}


def decode_step_floor(args, seconds: dict, response_lens: list[int]) -> float:
    """Seconds of the GEMMs of one rollout's decode steps when every step runs only its live rows:
    step t >= 1 (token 0 comes from the prefill) has m_t = #responses longer than t rows, and costs
    each linear's measured time at m_t rows (decode_seconds: the fastest way measured). At a fixed
    batch the long tail's steps run 1-2 rows, where the LM head's GEMM is bound by reading its
    weight (V x hidden), not by FLOPs:
    this is the least any engine spends decoding these lengths without more prompts to batch."""
    from bench_gemm_floor import linears

    total = 0.0
    for t in range(1, max(response_lens, default=0)):
        m = sum(n > t for n in response_lens)
        total += sum(seconds[(name, m)] * (1 if name == "lm head" else args.layers)
                     for name, _, _ in linears(args))
    return total


# ---------------------------------------------------------------------------------------------
# TRL, in a subprocess of its own venv


def ensure_trl_venv(spec: str) -> str:
    """bench/.venv-trl/bin/python with TRL importable and this process's torch version (created
    and installed on first use; torch re-pinned when it no longer matches)."""
    import torch

    python = os.path.join(VENV, "bin", "python")
    pin = f"torch=={torch.__version__.split('+')[0]}"  # 2.13.0 also matches a local 2.13.0+cpu wheel
    probe = [python, "-c", "import torch, trl, transformers, datasets, accelerate; "
             f"assert torch.__version__ == {torch.__version__!r}, torch.__version__"]
    if os.path.exists(python) and subprocess.run(probe, capture_output=True).returncode == 0:
        return python
    print(f"creating {VENV} and installing {pin} {spec} (once) ...", flush=True)
    if not os.path.exists(python):
        subprocess.run([sys.executable, "-m", "venv", VENV], check=True)  # no system site-packages
    subprocess.run([python, "-m", "pip", "install", "-q", pin, spec, "datasets", "accelerate"], check=True)
    subprocess.run(probe, check=True)
    return python


class TRLWorker:
    """The TRL subprocess: after `start`, `step()` lets it run one training step and returns its result."""

    def __init__(self, python: str, args, model_dir: str, prompts_file: str, work: str):
        cmd = [python, os.path.abspath(__file__), "--trl-worker", "--model-dir", model_dir,
               "--prompts-file", prompts_file, "--work", work]
        for key in ("steps", "threads", "prompts", "samples", "new_tokens", "micro_batch", "beta", "precision"):
            cmd += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
        self.log_path = os.path.join(work, "trl_worker.log")
        self.log = open(self.log_path, "w")
        env = dict(os.environ, PYTHONWARNINGS="ignore", TOKENIZERS_PARALLELISM="false",
                   HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                     text=True, bufsize=1, env=env)

    def _expect(self, tag: str) -> str:
        for line in self.proc.stdout:
            if line.startswith(tag):
                return line[len(tag):].strip()
            self.log.write(line)
        self.log.flush()
        with open(self.log_path) as f:
            tail = f.read()[-4000:]
        raise RuntimeError(f"TRL worker exited {self.proc.wait()} before {tag.strip()}; its log:\n{tail}")

    def wait_ready(self) -> None:
        self._expect("TRL_READY")

    def step(self) -> dict:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        result = json.loads(self._expect("TRL_STEP"))
        return result

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def trl_worker(args) -> None:
    """Runs inside the TRL venv: GRPOTrainer on args.model_dir, one step per 'go' line on stdin."""
    import torch

    torch.set_num_threads(args.threads)
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    rows = args.prompts * args.samples
    total_steps = args.steps + 1
    with open(args.prompts_file) as f:
        ds = Dataset.from_list([json.loads(line) for line in f])
    tok = AutoTokenizer.from_pretrained(args.model_dir)
    config = GRPOConfig(
        output_dir=os.path.join(args.work, "trl"), per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=rows // args.micro_batch, num_generations=args.samples,
        max_completion_length=args.new_tokens, num_iterations=1, beta=args.beta, epsilon=0.2,
        temperature=1.0, top_p=1.0, top_k=0, learning_rate=1e-6, weight_decay=0.0, max_grad_norm=1.0,
        lr_scheduler_type="constant", warmup_steps=0, max_steps=total_steps, seed=1, use_cpu=True,
        gradient_checkpointing=False,  # TRL's default (True) recomputes every layer; megarl does not
        bf16=args.precision == "bf16", fp16=False, loss_type="dapo",
        model_init_kwargs={"dtype": torch.bfloat16 if args.precision == "bf16" else torch.float32},
        logging_strategy="no", save_strategy="no", eval_strategy="no", report_to="none",
        log_completions=False, disable_tqdm=True, dataloader_num_workers=0)

    phases: dict = {}
    in_scoring = [False]

    class Clock(TrainerCallback):
        """Blocks between steps until the parent says go; reports each step's wall and CPU seconds."""

        def _wait(self):
            print("TRL_READY", flush=True)
            if not sys.stdin.readline():
                os._exit(0)
            phases.clear()
            self.t0, self.c0 = time.perf_counter(), time.process_time()

        def on_train_begin(self, *a, **k):
            self._wait()

        def on_step_end(self, cb_args, state, control, **k):
            wall, cpu = time.perf_counter() - self.t0, time.process_time() - self.c0
            p = dict(phases)
            gen_score = p.pop("generate_and_score", 0.0)
            p["advantages"] = gen_score - sum(p.get(n, 0.0) for n in ("generate", "score_actor", "score_reference",
                                                                      "rewards"))
            p["train_actor"] = wall - gen_score
            lengths = trainer._metrics["train"].get("completions/mean_length", [float("nan")])
            print("TRL_STEP " + json.dumps({"wall": wall, "cpu": cpu, "phases": p, "response_len": lengths[-1]}),
                  flush=True)
            if state.global_step < total_steps:
                self._wait()

    trainer = GRPOTrainer(model=args.model_dir, reward_funcs=[reward], args=config, train_dataset=ds,
                          processing_class=tok, callbacks=[Clock()])

    def timed(name, fn, flag=False):
        def wrapper(*a, **k):
            if flag:
                in_scoring[0] = True
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                phases[name] = phases.get(name, 0.0) + time.perf_counter() - t0
                if flag:
                    in_scoring[0] = False
        return wrapper

    logps = trainer._get_per_token_logps_and_entropies

    def logps_timed(model, *a, **k):
        if not in_scoring[0]:  # the training forward: part of train_actor
            return logps(model, *a, **k)
        name = "score_reference" if model is trainer.ref_model else "score_actor"
        return timed(name, logps)(model, *a, **k)

    trainer._get_per_token_logps_and_entropies = logps_timed
    trainer._generate = timed("generate", trainer._generate)
    trainer._calculate_rewards = timed("rewards", trainer._calculate_rewards)
    trainer._generate_and_score_completions = timed("generate_and_score", trainer._generate_and_score_completions,
                                                    flag=True)
    trainer.train()


# ---------------------------------------------------------------------------------------------
# Report


def median_rates(measured: list[dict]) -> dict:
    """Each (linear, kind)'s median GFLOP/s over gemm_rates measurements (one beside each step)."""
    return {key: statistics.median(r[key] for r in measured) for key in measured[0]}


def summary(results: list[dict]) -> dict:
    walls, cpus = [r["wall"] for r in results], [r["cpu"] for r in results]
    phase_names = list(results[0]["phases"])
    return {"best": min(walls), "median": statistics.median(walls), "cpu_best": min(cpus),
            "cpu_median": statistics.median(cpus), "cpu_mean": statistics.mean(cpus),
            "phases": {p: statistics.median(r["phases"][p] for r in results) for p in phase_names},
            "response_len": statistics.mean(r["response_len"] for r in results),
            "response_lens": [r["response_lens"] for r in results if "response_lens" in r],
            "prompt_len": statistics.mean(r.get("prompt_len", 0.0) for r in results),
            "steps": results}


def report(args, mg: dict, trl: dict | None, decode_s: dict | None = None) -> None:
    """The tables and ratios; the floor's GEMM rates are those measured beside megarl's steps
    (r["rates"] of each step in mg["steps"]: fp32 runs only)."""
    measured = [r["rates"] for r in mg["steps"] if "rates" in r]
    rates = median_rates(measured) if measured else None
    rows = args.prompts * args.samples
    prompt = f"{args.prompt_min}..{args.prompt_len}" if args.prompt_min != args.prompt_len else args.prompt_len
    ending = f" (up to; EOS, mean target {args.mean_len})" if args.workload == "realistic" else ""
    print(f"\n## RL step ({args.workload} workload): GRPO, {args.prompts} prompts x {args.samples} samples, "
          f"prompt {prompt} + {args.new_tokens}{ending} new tokens, Llama hidden {args.hidden}, ffn {args.ffn}, {args.layers} layers, "
          f"{args.heads} heads ({args.kv_heads} KV), vocab {args.vocab}, {args.precision}"
          f", 1 PPO epoch, 1 optimizer step "
          f"of {rows // args.micro_batch} micro-batches x {args.micro_batch}, beta {args.beta}, "
          f"{args.threads} thread(s), 1 warm-up + {args.steps} timed steps each, interleaved\n")
    print("| framework | best s/step (wall) | median s/step (wall) | best CPU-s/step | median CPU-s/step "
          "| mean response length |")
    print("|---|---|---|---|---|---|")
    for name, s in (("megarl", mg), ("TRL GRPOTrainer", trl)):
        if s is not None:
            print(f"| {name} | {s['best']:.2f} | {s['median']:.2f} | {s['cpu_best']:.2f} | {s['cpu_median']:.2f} "
                  f"| {s['response_len']:.1f} |")
    if trl is not None:
        print()
        for what, a, b in (("wall", "best", "median"), ("CPU", "cpu_best", "cpu_median")):
            print(f"megarl / TRL seconds per step ({what}): {mg[a] / trl[a]:.2f}x best, "
                  f"{mg[b] / trl[b]:.2f}x median (target <= 0.5x)")
    print("\nPhase breakdown, median wall seconds per step (TRL: from timers around its methods; "
          "score_actor 0 = TRL reuses the training forward as old log-probs when on-policy):\n")
    names = list(PHASES) + (["rewards"] if trl is not None else [])
    print("| phase | megarl s | megarl % | TRL s | TRL % |")
    print("|---|---|---|---|---|")
    for p in names:
        m = mg["phases"].get(p)
        t = trl["phases"].get(p, 0.0) if trl is not None else None
        ms = f"{m:.2f} | {100 * m / mg['median']:.0f}%" if m is not None else "(in score_reference) | -"
        ts = f"{t:.2f} | {100 * t / trl['median']:.0f}%" if t is not None else "- | -"
        print(f"| {p} | {ms} | {ts} |")
    if rates:
        flops = necessary_flops(args, mg["prompt_len"], mg["response_len"])
        shares = phase_floors(args, rates, mg["prompt_len"], mg["response_len"])
        floor, gen = shares["step"], shares["generate"]
        print(f"\nGEMM floor of the necessary work (megarl's mean prompt {mg['prompt_len']:.0f} + response "
              f"{mg['response_len']:.0f} tokens; prefill once per prompt, no padding, no prompt logits): "
              f"{sum(flops.values()) / 1e9:.0f} GFLOP at the fastest fp32 GEMM's rates on these shapes "
              f"(MKL or oneDNN; each GEMM's best of 3, the median over the measurements beside the steps) = "
              f"{floor:.2f} CPU-s per step (generation {gen:.2f}); megarl's mean CPU-s per step / floor "
              f"(both at the steps' mean lengths: GEMM work is linear in them) = {mg['cpu_mean'] / floor:.2f}x "
              f"(target <= 1.25x)"
              + (f"; TRL {trl['cpu_mean'] / floor:.2f}x (its mean response {trl['response_len']:.0f} tokens)"
                 if trl is not None else ""))
        beside = [phase_floors(args, r["rates"], r["prompt_len"], r["response_len"])["step"] for r in mg["steps"]]
        per_step = [r["cpu"] / f for r, f in zip(mg["steps"], beside)]
        pairs = ", ".join(f"{r['cpu']:.2f} / {f:.2f} = {x:.2f}x" for r, f, x in zip(mg["steps"], beside, per_step))
        print(f"\nmegarl per step against the floor at that step's own lengths, its GEMM rates measured right "
              f"after the step: {pairs} CPU-s (median {statistics.median(per_step):.2f}x, "
              f"mean {statistics.mean(per_step):.2f}x)")
        drift = [phase_floors(args, m, mg["prompt_len"], mg["response_len"])["step"] for m in measured]
        print(f"The floor at the mean lengths with each measurement's rates: {', '.join(f'{f:.2f}' for f in drift)} "
              f"CPU-s ({max(drift) / min(drift):.2f}x between the slowest and the fastest; the summary uses each "
              f"GEMM's median rate)")
        print("\n| phase | megarl s (phases: median wall; step: mean CPU) | FLOP floor, CPU-s | ratio |\n|---|---|---|---|")
        for p, f in shares.items():
            m = mg["cpu_mean"] if p == "step" else mg["phases"][p]
            print(f"| {p} | {m:.2f} | {f:.2f} | {m / f:.2f}x |")
        if mg["response_lens"] and decode_s:
            # prefill once per prompt at the training GEMMs' rate, then the decode steps as they come
            from bench_gemm_floor import linears

            prefill = sum(2 * n * k * args.layers * args.prompts * mg["prompt_len"] / 1e9 / rates[(name, "fwd")]
                          for name, n, k in linears(args) if name != "lm head")
            steps = statistics.mean(decode_step_floor(args, decode_s, lens) for lens in mg["response_lens"]) + prefill
            print(f"\nGeneration at this batch's own decode steps (step t runs only its live rows, each linear "
                  f"at its measured time for that many rows, the fastest way: MKL or oneDNN on either "
                  f"weight memory; the long tail's 1-2-row steps are bound by "
                  f"reading the LM head's weight, which the FLOP floor above does not count): {steps:.2f} "
                  f"CPU-s per step; megarl's generate phase {mg['phases']['generate']:.2f} s (median) = "
                  f"{mg['phases']['generate'] / steps:.2f}x. The whole step against the floor with this "
                  f"generation floor ({floor - gen + steps:.2f} CPU-s): megarl {mg['cpu_mean'] / (floor - gen + steps):.2f}x")
    tokens = rows * args.new_tokens
    print(f"\ngenerate: megarl {tokens / mg['phases']['generate']:.0f} new tokens/s"
          + (f", TRL {tokens / trl['phases']['generate']:.0f} new tokens/s" if trl is not None else "")
          + f" (at full length {args.new_tokens})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="hidden 128, 2 layers, vocab 4096, 2 prompts x 4 samples, 16 new tokens, 1 timed step")
    ap.add_argument("--steps", type=int, default=3, help="timed steps each, after one warm-up step")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--ffn", type=int, default=1408)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=8, help="rows per forward/backward micro-batch")
    ap.add_argument("--beta", type=float, default=0.04, help="KL coefficient")
    ap.add_argument("--old-logprobs", choices=("rollout", "recompute"), default="rollout",
                    help="megarl's rl.old_logprobs; rollout matches TRL, which with 1 epoch x 1 mini-batch "
                         "computes no old log-probs either")
    ap.add_argument("--no-trl", action="store_true", help="time megarl only")
    ap.add_argument("--trl-spec", default="trl==1.16.0", help="what pip installs into bench/.venv-trl")
    ap.add_argument("--profile", action="store_true", help="torch.profiler top ops of one more megarl step")
    ap.add_argument("--workload", choices=("default", "realistic"), default="default",
                    help="realistic: prompts 40..200 tokens, EOS-ended long-tailed responses up to 1024, "
                         "vocab 151936 at hidden 256 (set before other options apply)")
    ap.add_argument("--mean-len", type=int, default=200, help="realistic: target mean response length")
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                    help="both frameworks' training precision (bf16: the same on both sides)")
    ap.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ap.add_argument("--prompts-file", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    if ap.parse_known_args()[0].workload == "realistic":
        ap.set_defaults(**REALISTIC)  # explicit options still win
    args = ap.parse_args()
    if args.steps < 1:
        ap.error("--steps must be >= 1 (timed steps after the warm-up)")
    args.prompt_min = 40 if args.workload == "realistic" else args.prompt_len
    if args.trl_worker:
        return trl_worker(args)
    if args.quick:
        args.hidden, args.ffn, args.layers, args.heads, args.kv_heads, args.vocab = 128, 352, 2, 4, 4, 4096
        args.prompts, args.samples, args.new_tokens, args.micro_batch, args.steps = 2, 4, 16, 4, 1
    rows = args.prompts * args.samples
    if rows % args.micro_batch:
        ap.error(f"--micro-batch ({args.micro_batch}) must divide prompts x samples ({rows})")
    args.max_pos = max(256, args.prompt_len + args.new_tokens)

    import torch

    torch.set_num_threads(args.threads)
    sys.path.insert(0, ROOT)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_gemm_floor, timing
    python = None if args.no_trl else ensure_trl_venv(args.trl_spec)
    with tempfile.TemporaryDirectory(prefix="bench_rl_step_") as work:
        model_dir, prompts_file = build_assets(args, work)
        worker = None if python is None else TRLWorker(python, args, model_dir, prompts_file, work)
        try:
            stage = build_megarl(args, model_dir, prompts_file, work)
            if worker is not None:
                worker.wait_ready()
            mg_runs, trl_runs = [], []
            fp32 = args.precision == "fp32"
            for step in range(args.steps + 1):  # step 0: warm-up
                r = megarl_step(stage, step)
                print(f"step {step}{' (warm-up)' if step == 0 else ''}: megarl {r['wall']:.2f} s, {r['cpu']:.2f} CPU-s "
                      f"({', '.join(f'{k} {v:.2f}' for k, v in r['phases'].items())}; mean prompt "
                      f"{r['prompt_len']:.0f} + response {r['response_len']:.0f} tokens)", flush=True)
                if step:
                    mg_runs.append(r)
                    if fp32:  # the floor's GEMM rates beside this step (the machine's speed drifts)
                        r["rates"] = gemm_rates(args)
                        floor = phase_floors(args, r["rates"], r["prompt_len"], r["response_len"])["step"]
                        print(f"step {step}: GEMM floor at its lengths, measured after it: {floor:.2f} CPU-s "
                              f"(megarl {r['cpu'] / floor:.2f}x)", flush=True)
                if worker is not None:
                    t = worker.step()
                    print(f"step {step}{' (warm-up)' if step == 0 else ''}: TRL {t['wall']:.2f} s, {t['cpu']:.2f} CPU-s "
                          f"({', '.join(f'{k} {v:.2f}' for k, v in t['phases'].items())}; mean response "
                          f"{t['response_len']:.0f} tokens)", flush=True)
                    if step:
                        trl_runs.append(t)
            report(args, summary(mg_runs), summary(trl_runs) if trl_runs else None,
                   decode_seconds(args) if fp32 else None)
            if args.profile:
                from torch.profiler import ProfilerActivity, profile

                with profile(activities=[ProfilerActivity.CPU]) as prof:
                    stage.step(args.steps + 1)
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
        finally:
            if worker is not None:
                worker.close()


if __name__ == "__main__":
    main()
