"""Sampled evaluation on held-out prompts: pass@1, pass@k (unbiased, Chen et al. 2021), mean@k.

The metrics are named `pass_at_1`, `pass_at_<k>` and `mean_at_<k>` (MLflow's keys allow no '@';
metrics.jsonl, MLflow and the report use the same names). mean@k, the mean reward, equals
pass@1 when every score is 0 or 1 (final_answer, gsm8k, exact_match): it is then left out.

    megarl eval --config X [--checkpoint P | --hf DIR] [key=value ...]

Used by the RL stage every `train.eval_interval` steps and by `megarl eval` on any checkpoint
(the SFT model, an RL actor, a Hugging Face model). Prompts are split over DP ranks in
contiguous blocks and each sample's randomness is keyed by its global index, so the figures
do not depend on the layout.
"""
from __future__ import annotations

import json
import logging
import os

from megarl.config import Config, ConfigError
from megarl.rollout.sampling import SamplingParams
from megarl.runtime.distributed import is_rank0

log = logging.getLogger("megarl")

STAGE = "eval"
SAMPLE_ROWS = 8  # prompts shown in the sample table


def metric_names(k: int) -> tuple[str, str, str]:
    """The metric names of pass@1, pass@k and mean@k for k samples per prompt (MLflow-valid)."""
    return "pass_at_1", f"pass_at_{k}", f"mean_at_{k}"


def rl_sampling(r, stop_ids, n: int, temperature: float) -> SamplingParams:
    """n samples per prompt at `temperature` (0: greedy) with the rl section's top-k, top-p and
    length: RL's rollouts and every held-out evaluation sample through it."""
    greedy = temperature == 0
    return SamplingParams(n=n, temperature=1.0 if greedy else temperature, greedy=greedy, top_k=r.top_k,
                          top_p=r.top_p, max_new_tokens=r.max_new_tokens, stop_ids=tuple(stop_ids))


def eval_sampling(r, stop_ids) -> SamplingParams:
    """The sampling of held-out evaluation (`megarl eval` and RL's): rl.eval_samples per prompt at
    rl.eval_temperature, greedy at 0."""
    return rl_sampling(r, stop_ids, r.eval_samples, r.eval_temperature)


def sample_and_grade(engine, items: list, tok, params, seed: int, sample_offset: int, reward_fn):
    """Samples params.n responses per prompt item and grades each: (rollout, prompts, texts,
    answers, scores), the last four flat lists of len(items) x n, prompt-major. A reward function
    that fails on a sample scores it 0 here (evaluation grades; it does not stop on bad samples)."""
    from megarl.rewards import score_batch

    k = params.n
    rollout = engine.generate([it["prompt_ids"] for it in items], params, seed=seed, sample_offset=sample_offset)
    texts = [tok.decode(r, skip_special_tokens=True) for r in rollout.responses()]
    prompts = [it["messages"][-1]["content"] for it in items for _ in range(k)]
    answers = [it["answer"] for it in items for _ in range(k)]
    scores = score_batch(reward_fn, prompts, texts, answers, max_fail_fraction=1.0).scores
    return rollout, prompts, texts, answers, scores


def pass_at_k_eval(engine, dataset, tok, *, n_prompts: int, k: int, params, seed: int, reward_fn) -> tuple[dict, list]:
    """(metrics, sample rows) over the first `n_prompts` prompts of `dataset`, k samples each.

    A sample is correct when its reward is > 0 (use a 0/1 reward such as final_answer). With an
    engine that has tools (rl.tools), pass@k is with tools, and the tool metrics come too: calls
    and failed calls per sample, the share of calls that succeed, observation tokens per sample,
    the share of samples ended on the call limit."""
    from megatron.core import parallel_state as ps

    from megarl.rewards import pass_at_k
    from megarl.runtime.distributed import dp_max, dp_means

    p1_name, pk_name, mk_name = metric_names(k)
    n = min(n_prompts, len(dataset))
    dp, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    lo, hi = rank * n // dp, (rank + 1) * n // dp
    items = [dataset[i] for i in range(lo, hi)]
    pairs = {p1_name: (0.0, 0), pk_name: (0.0, 0), mk_name: (0.0, 0), "response_len": (0.0, 0)}
    tools = getattr(engine, "tools", None) is not None
    if tools:
        pairs.update({name: (0.0, 0) for name in TOOL_METRICS})
    rows, graded = [], 0.0  # graded: some score is neither 0 nor 1, so mean@k says more than pass@1
    if items:
        rollout, prompts, texts, answers, scores = sample_and_grade(engine, items, tok, params, seed, lo * k, reward_fn)
        graded = float(any(x not in (0.0, 1.0) for x in scores))
        p1 = pk = mk = 0.0
        for i in range(len(items)):
            s = scores[i * k:(i + 1) * k]
            c = sum(x > 0 for x in s)
            p1 += pass_at_k(k, c, 1)
            pk += pass_at_k(k, c, k)
            mk += sum(s) / k
        m = len(items)
        lens = rollout.response_lens.double()
        pairs = {p1_name: (p1, m), pk_name: (pk, m), mk_name: (mk, m), "response_len": (lens.sum().item(), len(lens))}
        rows = [{"prompt": prompts[i * k], "completion": texts[i * k], "answer": answers[i * k],
                 "reward": scores[i * k]} for i in range(min(m, SAMPLE_ROWS))]
        if tools:
            pairs.update(tool_metric_pairs(rollout))
            for i, row in enumerate(rows):
                row["tool_calls"] = int(rollout.tool_calls[i * k])
    elif getattr(engine, "ep_group", None) is not None:  # no prompts here: still step with the expert-parallel ranks
        engine.generate([], params, seed=seed)
    if not dp_max(graded):
        del pairs[mk_name]
    return dp_means(pairs), rows if rank == 0 else []


TOOL_METRICS = ("tool_calls_per_sample", "tool_errors_per_sample", "tool_call_success", "observation_tokens",
                "tool_call_limit_rows")


def rollout_engine(cfg: Config, actor, tok):
    """The rollout engine on `actor` (a Role) that RL and `megarl eval` sample with, with rl.tools."""
    from megarl.roles import offload
    from megarl.rollout.engine import MegatronRolloutEngine
    from megarl.rollout.tools import make_toolbox

    r = cfg.rl
    tools = make_toolbox(r.tools, max_calls=r.max_tool_calls, timeout_s=r.tool_timeout_s,
                         max_output_chars=r.tool_max_output_chars, python=r.python_tool)
    engine = MegatronRolloutEngine(actor, vocab_size=cfg.model.vocab_size, pad_id=tok.pad_id, decode=tok.decode,
                                   encode=tok.encode, tools=tools, max_batch_size=r.rollout_batch_size,
                                   cuda_graphs=r.cuda_graphs, sync_every=r.decode_sync_every)
    offload.register_workspace(actor, "decode", engine.workspace)  # released before the actor's weights move
    return engine


def tool_metric_pairs(rollout) -> dict:
    """{metric: (sum, count)} of a Rollout's tool stats (megarl.rollout.engine.Rollout), for dp_means."""
    n, calls, errors = len(rollout.tool_calls), rollout.tool_calls.sum().item(), rollout.tool_errors.sum().item()
    return {"tool_calls_per_sample": (calls, n), "tool_errors_per_sample": (errors, n),
            "tool_call_success": (calls - errors, calls), "observation_tokens": (rollout.observation_tokens.sum().item(), n),
            "tool_call_limit_rows": (rollout.hit_call_limit.sum().item(), n),
            "tool_timeouts_per_sample": (rollout.tool_timeouts.sum().item(), n)}


EVAL_STAGES = ("sft", "rl", "dpo")  # stage names `--checkpoint` accepts: their latest checkpoint


def eval_source(cfg: Config, checkpoint: str | None, hf: str | None) -> str:
    """The directory `megarl eval` loads: --hf's, or --checkpoint's (a stage name: its latest
    checkpoint in train.run_dir; default sft). A directory of the wrong kind is named for what
    it is not, in one line, before anything is written."""
    from megarl.checkpoint.distributed import LATEST, MANIFEST

    def is_checkpoint(d):
        return os.path.isfile(os.path.join(d, MANIFEST)) or os.path.isfile(os.path.join(d, LATEST))

    if hf and checkpoint:
        raise ConfigError("megarl eval: give --checkpoint or --hf, not both")
    flag, path = ("--hf", hf) if hf else ("--checkpoint", checkpoint or "sft")
    if not hf and path in EVAL_STAGES:
        root = os.path.join(os.path.abspath(cfg.train.run_dir), path, "checkpoints")
        if not os.path.isfile(os.path.join(root, LATEST)):
            raise ConfigError(f"--checkpoint {path}: no checkpoint at {root}; run `megarl {path}` with the same "
                              "train.run_dir first, or give a checkpoint directory (or --hf DIR)")
        return root
    if not os.path.exists(path):
        raise ConfigError(f"{flag} {path}: does not exist" + ("" if hf else f" (nor is it a stage name: {', '.join(EVAL_STAGES)})"))
    if not os.path.isdir(path):
        raise ConfigError(f"{flag} {path}: is a file, not a {'model' if hf else 'checkpoint'} directory")
    if hf and not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(f"--hf {path}: not a Hugging Face model directory (no config.json)"
                          + ("; it is a megarl checkpoint: use --checkpoint" if is_checkpoint(path) else ""))
    if not hf and not is_checkpoint(path):
        hint = ("; it is a Hugging Face model directory: use --hf" if os.path.isfile(os.path.join(path, "config.json"))
                else f"; it is a stage directory: use {os.path.join(path, 'checkpoints')}"
                if os.path.isfile(os.path.join(path, "checkpoints", LATEST)) else "")
        raise ConfigError(f"--checkpoint {path}: not a megarl checkpoint (no {MANIFEST}: not a step directory; "
                          f"no '{LATEST}': not a checkpoint root){hint}")
    return path


def run_eval(cfg: Config, checkpoint: str | None = None, hf: str | None = None) -> dict:
    """`megarl eval`: sample the held-out prompts with a checkpoint's (or HF model's) LM; writes
    <run_dir>/eval/results.json and a new MLflow run (each eval its own) with the sample table,
    its metrics at the evaluated checkpoint's step."""
    from megarl.rewards import load_reward_fn
    from megarl.roles.role import Role
    from megarl.trainers import data_setup
    from megarl.trainers.common import mix_seed
    from megarl.trainers.weights import load_role_weights
    from megarl.trainers.session import stage_session
    from megarl.utils.atomic import write_atomic

    r = cfg.rl
    source = eval_source(cfg, checkpoint, hf)
    with stage_session(cfg, STAGE) as s:
        tok = data_setup.tokenizer(cfg)
        paths = data_setup.stage_paths(cfg, "eval")
        if not paths["eval"]:
            raise ConfigError("megarl eval: no held-out prompts (set rl.eval_prompts_path)")
        ds = data_setup.prompt_dataset(cfg, paths["eval"])
        role = Role("actor", cfg.model, cfg.parallel, head="lm", precision=cfg.train.precision, seed=cfg.train.seed)
        src = load_role_weights(cfg, role, source, "--hf" if hf else "--checkpoint")
        engine = rollout_engine(cfg, role, tok)
        params = eval_sampling(r, tok.stop_ids)
        metrics, rows = pass_at_k_eval(engine, ds, tok, n_prompts=r.eval_prompts, k=r.eval_samples, params=params,
                                       seed=mix_seed(cfg.train.seed, 99991), reward_fn=load_reward_fn(r.eval_reward_fn))
        metrics = {f"eval/{k}": v for k, v in metrics.items()}
        name = os.path.basename(os.path.normpath(src))
        step = int(name.split("_")[1]) if name.startswith("step_") and name.split("_")[1].isdigit() else 0
        n_prompts = min(r.eval_prompts, len(ds))
        s.tracker.set_tags({"megarl.eval_source": src, "megarl.eval_prompts": n_prompts,
                            "megarl.eval_samples": r.eval_samples})
        s.tracker.log_metrics(metrics, step=step)
        if rows:
            s.tracker.log_table(rows, name="eval_samples", step=step)
        if is_rank0():
            out = {"source": src, "step": step, "prompts_file": paths["eval"], "n_prompts": n_prompts,
                   "k": r.eval_samples, "temperature": r.eval_temperature, **metrics, "samples": rows}
            write_atomic(os.path.join(s.stage_dir, "results.json"), json.dumps(out, indent=1))
            log.info("eval of %s on %d prompts x %d samples (temperature %g, %s): %s (%s)", src, n_prompts,
                     r.eval_samples, r.eval_temperature, paths["eval"],
                     " | ".join(f"{k.split('/')[1]} {v:.4f}" for k, v in metrics.items()),
                     os.path.join(s.stage_dir, "results.json"))
        return metrics
