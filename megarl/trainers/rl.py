"""RL stage: PPO (critic + GAE), GRPO, RLOO, REINFORCE and REINFORCE++ on colocated roles.

    megarl rl --config configs/tiny_grpo.yaml [key=value ...]

One loop step, top to bottom (`RLStage.step`):
  1. generate:   this DP rank's prompts x n samples with the rollout engine on the actor;
  2. score:      old log-probs (actor), reference log-probs, values (critic), rewards (rule
                 and/or reward model): each role resident only for its phase;
  3. advantages: GAE with the critic, or group baselines (GRPO / RLOO / REINFORCE);
  4. train:      critic, then actor, `ppo_epochs` x `mini_batches` optimizer steps each.
The algorithms are pure functions in `megarl.algorithms`; this file only moves tensors between
them and the roles. Roles: actor and critic train (checkpointed with optimizer state), the
reference and the reward model are frozen and rebuilt from where they came from on resume.
"""
from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass

import torch

from megarl import algorithms as A
from megarl.config import Config, ConfigError
from megarl.config.schema import role_config
from megarl.models.gpt import mask_padded_vocab
from megarl.roles.role import Role
from megarl.rollout.engine import MegatronRolloutEngine, SamplingParams
from megarl.runtime.distributed import dp_group, dp_max, dp_means, dp_sum
from megarl.trainers import data_setup
from megarl.trainers.common import padding_waste, plan_microbatches
from megarl.trainers.loop import Stage, StageStopped, train_stage

log = logging.getLogger("megarl")

STAGE = "rl"
CRITIC_ALGORITHMS = ("ppo",)
LM_ROLES = ("sft", "actor", "reference")  # checkpoint role names whose output layer is an LM head
ACCURACY_REWARDS = ("final_answer", "gsm8k", "exact_match")  # 0/1 rewards: their mean is an accuracy


# ---------------------------------------------------------------------------------------------
# Experience: one step's rollouts on this DP rank as training tensors


@dataclass
class Experience:
    """Row i is one prompt + response, right-padded; column t predicts token t + 1."""

    tokens: torch.Tensor      # [N, L] long
    labels: torch.Tensor      # [N, L] long: tokens shifted left (pad at the end)
    mask: torch.Tensor        # [N, L] bool: True where labels[t] is a response token (an action)
    lengths: list             # [N] prompt + response length: the columns a row needs
    scores: torch.Tensor      # [N] fp32 sequence reward (rule + reward model)
    old_logp: torch.Tensor | None = None  # [N, L] fp32
    ref_logp: torch.Tensor | None = None
    values: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None

    def microbatch(self, rows: list[int]) -> dict:
        """Rows `rows`, cut to their longest sequence, as a Role micro-batch.

        The model's head runs only from the first column that predicts a response token
        (`output_from`: no logits for the prompt prefix the rows share), so every per-token
        field is given from that column on: [b, width - output_from]."""
        width = max(self.lengths[i] for i in rows)
        idx = torch.tensor(rows)
        first = int(self.mask[idx, :width].int().argmax(1).min())  # earliest action column of these rows
        mb = {"tokens": self.tokens[idx, :width], "position_ids": torch.arange(width).expand(len(rows), width),
              "attention_mask": None, "output_from": first,
              "labels": self.labels[idx, first:width], "mask": self.mask[idx, first:width]}
        for name in ("old_logp", "ref_logp", "values", "advantages", "returns"):
            value = getattr(self, name)
            if value is not None:
                mb[name] = value[idx, first:width]
        return mb


def experience_from_rollout(rollout, pad_id: int) -> Experience:
    tokens = rollout.tokens  # [N, L]
    n, width = tokens.shape
    labels = torch.full_like(tokens, pad_id)
    labels[:, :-1] = tokens[:, 1:]
    cols = torch.arange(width)
    first = rollout.prompt_lens - 1  # column predicting the first response token
    mask = (cols >= first[:, None]) & (cols < (first + rollout.response_lens)[:, None])  # [N, L]
    lengths = (rollout.prompt_lens + rollout.response_lens).tolist()
    return Experience(tokens, labels, mask, lengths, torch.zeros(n))


# ---------------------------------------------------------------------------------------------
# Roles


def _checkpoint_source(cfg: Config, source: str, key: str) -> str:
    """'sft' / 'reward_model' -> that stage's latest checkpoint in this run dir; a path -> itself."""
    from megarl.checkpoint.distributed import latest_checkpoint, resolve_checkpoint

    if source in ("sft", "reward_model"):
        root = os.path.join(os.path.abspath(cfg.train.run_dir), source, "checkpoints")
        path = latest_checkpoint(root)
        if path is None:
            cmd = "megarl sft" if source == "sft" else "megarl rm"
            raise ConfigError(f"{key}={source}: no checkpoint at {root}; run `{cmd}` with the same train.run_dir "
                              "first, or point it at a checkpoint or Hugging Face directory")
        return path
    if not os.path.exists(source):
        raise ConfigError(f"{key}: {source} does not exist")
    return resolve_checkpoint(source)


def load_role_weights(cfg: Config, role: Role, source: str, key: str) -> str:
    """Initialise `role` from a stage name, a megarl checkpoint or a Hugging Face directory.
    A scalar head started from an LM checkpoint keeps its fresh head (and the reverse is an error)."""
    import json

    from megarl.checkpoint.distributed import MANIFEST, load_weights

    if source == "random":  # train.seed's layout-invariant initialisation (tests, benchmarks)
        return "random initialisation"
    path = _checkpoint_source(cfg, source, key)
    if os.path.isfile(os.path.join(path, "config.json")):  # Hugging Face: an LM (a scalar role keeps its head)
        data_setup.init_weights(cfg, role, _with_init(role.model_cfg, path), skip_head=role.head != "lm")
        return path
    with open(os.path.join(path, MANIFEST)) as f:
        saved = json.load(f)["roles"]
    name = role.name if role.name in saved else (saved[0] if len(saved) == 1 else None)
    if name is None:
        raise ConfigError(f"{key}: {path} holds roles {', '.join(saved)}; none is named {role.name}")
    saved_head = "lm" if name in LM_ROLES else "scalar"
    if saved_head == "scalar" and role.head == "lm":
        raise ConfigError(f"{key}: {path} holds a scalar-head model ({name}); the {role.name} needs a language model")
    load_weights(path, role, saved_role=name, skip_head=saved_head != role.head)
    return path


def _with_init(model_cfg, path):
    import dataclasses

    return dataclasses.replace(model_cfg, init_from=path)


def needed_roles(cfg: Config) -> list[str]:
    """Which roles exist follows the algorithm and the reward."""
    r = cfg.rl
    roles = ["actor"]
    if r.kl_coef > 0 or r.kl_target is not None:
        roles.append("reference")
    if r.algorithm in CRITIC_ALGORITHMS:
        roles.append("critic")
    if r.reward_model_coef > 0:
        roles.append("reward")
    return roles


def optimizer_steps(cfg: Config) -> int:
    """The LR schedule's length: optimizer steps, not loop steps."""
    return cfg.train.steps * cfg.rl.ppo_epochs * cfg.rl.mini_batches


def build_roles(cfg: Config) -> dict:
    roles = {}
    for name in needed_roles(cfg):
        rc = role_config(cfg, name)
        trained = name in ("actor", "critic")
        role = Role(name, rc.model, cfg.parallel, head="lm" if name in ("actor", "reference") else "scalar",
                    precision=rc.precision, fp8=cfg.train.fp8, seed=cfg.train.seed,
                    optim=rc.optim if trained else None, schedule=rc.lr_schedule, train_steps=optimizer_steps(cfg))
        src = load_role_weights(cfg, role, rc.init_from, f"roles.{name}.init_from")
        log.info("%s initialised from %s", name, src)
        roles[name] = role
    return roles


# ---------------------------------------------------------------------------------------------
# Per-token quantities from a role's output (run on the last pipeline stage)


def _token_logprobs(vocab_size: int, temperature: float, with_entropy: bool = False):
    from megatron.core import parallel_state as ps

    from megarl.ops import logprobs_and_entropy

    def fn(batch, logits):  # logits [b, s, V_pad/tp]
        logits = mask_padded_vocab(logits, vocab_size)
        return logprobs_and_entropy(logits, batch["labels"], tp_group=ps.get_tensor_model_parallel_group(),
                                    temperature=temperature, with_entropy=with_entropy)

    return fn


def collect_per_token(role: Role, exp: Experience, groups: list[list[int]], fn) -> torch.Tensor:
    """A [N, L] fp32 tensor from `fn(batch, output) -> [b, s]` over every micro-batch (forward only)."""
    mbs = [exp.microbatch(g) for g in groups]
    out = torch.zeros(exp.tokens.shape, dtype=torch.float32)
    for g, mb, part in zip(groups, mbs, role.forward_collect(mbs, lambda b, o: fn(b, o).float().cpu())):
        c = mb["output_from"]
        out[torch.tensor(g), c: c + part.shape[1]] = part
    return out


# ---------------------------------------------------------------------------------------------
# The stage


class RLStage(Stage):
    def __init__(self, cfg: Config, stage_dir: str):
        from megatron.core import parallel_state as ps

        from megarl.data import DataIterator
        from megarl.rewards import load_reward_fn
        from megarl.roles.residency import PhaseScheduler

        self.cfg, r = cfg, cfg.rl
        self.name = STAGE
        self.tok = data_setup.tokenizer(cfg)
        self.dp_rank, self.dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        paths = data_setup.stage_paths(cfg, STAGE)
        train_ds = data_setup.prompt_dataset(cfg, paths["train"])
        self.prompts = DataIterator(train_ds, r.prompts_per_step // self.dp_size, r.prompts_per_step, self.dp_rank,
                                    self.dp_size, seed=data_setup.data_seed(cfg))
        self.eval_ds = data_setup.prompt_dataset(cfg, paths["eval"]) if paths["eval"] else None
        self.all_roles = build_roles(cfg)
        self.roles = {n: role for n, role in self.all_roles.items() if role.trained}  # checkpointed
        self.actor = self.all_roles["actor"]
        self.engine = MegatronRolloutEngine(self.actor, vocab_size=cfg.model.vocab_size, pad_id=self.tok.pad_id,
                                            decode=self.tok.decode, max_batch_size=r.rollout_batch_size)
        self.reward_fn = load_reward_fn(r.reward_fn) if r.reward_fn else None
        self.eval_reward_fn = load_reward_fn(r.eval_reward_fn)
        if r.kl_target is not None:
            self.kl_ctl = A.AdaptiveKLController(r.kl_coef, r.kl_target, r.kl_horizon)
        else:
            self.kl_ctl = A.FixedKLController(r.kl_coef)
        self.nonfinite_in_a_row = 0
        self.kl_over_ceiling = 0
        self.phases = PhaseScheduler(self.all_roles, self._phase_plan(), offloadable=self._offloadable())

    # -- residency ----------------------------------------------------------------------------

    def _offloadable(self) -> dict:
        out = {}
        for name in self.all_roles:
            o = role_config(self.cfg, name).offload
            out[name] = [k for k, on in (("params", o.params), ("grads", o.grads), ("optimizer", o.optimizer)) if on]
        return out

    def _phase_plan(self) -> dict:
        names = set(self.all_roles)
        plan = {"generate": {"actor": ["params"]}, "score_actor": {"actor": ["params"]},
                "train_actor": {"actor": "all"}}
        for frozen in ("reference", "reward"):
            if frozen in names:
                plan[f"score_{frozen}"] = {frozen: ["params"]}
        if "critic" in names:
            plan["score_critic"] = {"critic": ["params"]}
            plan["train_critic"] = {"critic": "all"}
        return plan

    # -- one loop step ------------------------------------------------------------------------

    def step(self, step: int) -> dict:
        self.metrics, self.timings = {}, {}
        exp, rollout = self.make_experience(step)  # 1. generate, 2. score, 3. advantages
        if exp is None:
            return self._skip(step, "non-finite reward or advantage")
        self.update(exp, step)  # 4. train critic, then actor
        metrics, timings = self.metrics, self.timings
        timings["end"] = time.perf_counter()
        if not math.isfinite(metrics.get("actor/loss", 0.0)) or metrics.get("actor/skipped_steps", 0):
            return self._skip(step, "non-finite loss")
        self.nonfinite_in_a_row = 0
        r = self.cfg.rl
        self.kl_ctl.update(metrics.get("kl/mean", 0.0), r.prompts_per_step * r.samples_per_prompt)
        self._check_kl_ceiling(metrics.get("kl/mean", 0.0), step)
        metrics["train/kl_coef"] = self.kl_ctl.value
        metrics.update(self._timings(timings, rollout))
        metrics.update(self.phases.ledger.metrics("memory/"))
        for name, usage in self.phases.ledger.cuda.items():  # the allocator's own peak per phase
            metrics[f"memory/{name}_cuda_peak_gib"] = usage["peak"] / 2**30
        return metrics

    def _phase(self, name: str) -> None:
        self.timings[name] = time.perf_counter()
        snap = self.phases.enter(name)
        self.metrics[f"memory/{name}_device_gib"] = snap["device_bytes"] / 2**30

    def make_experience(self, step: int):
        """(Experience with log-probs, values, scores and advantages, Rollout) for loop step
        `step`; (None, rollout) when a reward or advantage is not finite on some rank."""
        r = self.cfg.rl
        batch = next(self.prompts)
        self._phase("generate")
        params = self._sampling(r.temperature, r.samples_per_prompt)
        rows_per_rank = len(batch["prompt_ids"]) * r.samples_per_prompt
        rollout = self.engine.generate(batch["prompt_ids"], params, seed=_mix(self.cfg.train.seed, step),
                                       sample_offset=self.dp_rank * rows_per_rank)
        exp = experience_from_rollout(rollout, self.tok.pad_id)
        answers = [a for a in batch["answers"] for _ in range(r.samples_per_prompt)]
        prompts_text = [m[-1]["content"] for m in batch["messages"] for _ in range(r.samples_per_prompt)]
        responses = [self.tok.decode(ids, skip_special_tokens=True) for ids in rollout.responses()]
        groups = plan_microbatches(exp.lengths, max_rows=r.micro_batch_size, max_tokens=r.max_tokens_per_micro_batch)

        logprobs = _token_logprobs(self.cfg.model.vocab_size, r.temperature)
        if r.old_logprobs == "rollout":  # the sampled distribution's own log-probs, moved to label columns
            exp.old_logp = torch.zeros(exp.tokens.shape, dtype=torch.float32)
            exp.old_logp[exp.mask] = rollout.logprobs[rollout.response_mask]
        else:
            self._phase("score_actor")
            exp.old_logp = collect_per_token(self.actor, exp, groups, lambda b, o: logprobs(b, o)[0])
        if "reference" in self.all_roles:
            self._phase("score_reference")
            exp.ref_logp = collect_per_token(self.all_roles["reference"], exp, groups, lambda b, o: logprobs(b, o)[0])
        if "critic" in self.all_roles:
            self._phase("score_critic")
            exp.values = collect_per_token(self.all_roles["critic"], exp, groups, lambda b, o: o.squeeze(-1))
        exp.scores = self._scores(exp, prompts_text, responses, answers, groups)

        self.timings["advantages"] = time.perf_counter()
        self._advantages(exp)
        bad = not (bool(torch.isfinite(exp.scores).all()) and bool(torch.isfinite(exp.advantages).all()))
        resp = rollout.response_lens.double()
        self.metrics.update(dp_means({
            "rollout/response_len_mean": (resp.sum(), len(resp)),
            "rollout/stopped_fraction": (rollout.stopped.double().sum(), len(resp)),
            "train/padding_waste": (padding_waste(exp.lengths, groups) * len(groups), len(groups))}))
        self.metrics["rollout/response_len_max"] = dp_max(float(resp.max()))
        return (None if dp_max(float(bad)) > 0 else exp), rollout

    def update(self, exp: Experience, step: int) -> None:
        """Critic first (on the values the actor's advantages were built from), then actor."""
        if "critic" in self.all_roles:
            self._phase("train_critic")
            self.metrics.update(self._train(self.all_roles["critic"], exp, self._value_loss(), step, "critic"))
        self._phase("train_actor")
        self.metrics.update(self._train(self.actor, exp, self._policy_loss(), step, "actor"))

    def _sampling(self, temperature: float, n: int) -> SamplingParams:
        r = self.cfg.rl
        return SamplingParams(n=n, temperature=temperature, top_k=r.top_k, top_p=r.top_p,
                              max_new_tokens=r.max_new_tokens, stop_ids=tuple(self.tok.stop_ids))

    def _scores(self, exp, prompts_text, responses, answers, groups) -> torch.Tensor:
        """Sequence scores: rule reward (+ coef x reward model at the last response token)."""
        from megarl.rewards import score_batch

        r = self.cfg.rl
        scores = torch.zeros(len(responses), dtype=torch.float32)
        pairs = {}
        if self.reward_fn is not None:
            result = score_batch(self.reward_fn, prompts_text, responses, answers,
                                 max_fail_fraction=r.max_reward_failures)
            rule = torch.tensor(result.scores, dtype=torch.float32)
            scores += rule
            pairs["reward/rule_mean"] = (rule.double().sum(), len(rule))
            pairs["reward/failed_fraction"] = (float(result.n_failed), len(rule))
            if r.reward_fn in ACCURACY_REWARDS:
                pairs["reward/accuracy"] = ((rule > 0).double().sum(), len(rule))
        if "reward" in self.all_roles:
            self._phase("score_reward")
            last = torch.tensor(exp.lengths) - 1
            values = collect_per_token(self.all_roles["reward"], exp, groups, lambda b, o: o.squeeze(-1))
            rm = values[torch.arange(len(last)), last]
            scores += r.reward_model_coef * rm
            pairs["reward/model_mean"] = (rm.double().sum(), len(rm))
        scores = A.clip_rewards(scores, r.reward_clip)
        pairs["reward/mean"] = (scores.double().sum(), len(scores))
        pairs["reward/sq_mean"] = ((scores.double() ** 2).sum(), len(scores))
        means = dp_means(pairs)
        means["reward/std"] = math.sqrt(max(means.pop("reward/sq_mean") - means["reward/mean"] ** 2, 0.0))
        self.metrics.update(means)
        return scores

    def _advantages(self, exp: Experience) -> None:
        r, algo = self.cfg.rl, self.cfg.rl.algorithm
        mask = exp.mask
        metrics = self.metrics
        kl = None
        if exp.ref_logp is not None:
            kl = A.kl_estimate(exp.old_logp, exp.ref_logp, r.kl_estimator) * mask
            metrics.update(dp_means({"kl/mean": (kl.double().sum(), mask.sum())}))
        penalty = self.kl_ctl.value * kl if (kl is not None and r.kl_in == "reward") else None
        n = r.samples_per_prompt
        if algo in ("ppo", "reinforce_pp"):
            token_r = A.token_rewards(exp.scores, mask, penalty)
            if algo == "ppo":
                adv, ret = A.gae_advantages(token_r, exp.values, mask, r.gamma, r.lam)
                exp.returns = ret
                metrics.update(dp_means({"critic/returns_mean": ((ret.double() * mask).sum(), mask.sum())}))
            else:  # whitened over the global batch inside
                adv = A.reinforce_pp_advantages(token_r, mask, r.gamma, group=dp_group())
        else:
            seq = exp.scores if penalty is None else exp.scores - penalty.sum(1)
            if algo == "grpo":
                seq_adv = A.grpo_advantages(seq, n, scale_by_std=r.scale_by_std)
            elif algo == "rloo":
                seq_adv = A.rloo_advantages(seq, n)
            else:
                seq_adv = A.reinforce_advantages(seq, n)
            adv = A.broadcast_to_tokens(seq_adv, mask)
        whiten = r.whiten_advantages if r.whiten_advantages is not None else algo == "ppo"
        exp.advantages = (A.whiten(adv, mask, group=dp_group()) if whiten else adv * mask).float()

    # -- losses ---------------------------------------------------------------------------------

    def _policy_loss(self):
        r = self.cfg.rl
        logprobs = _token_logprobs(self.cfg.model.vocab_size, r.temperature, with_entropy=r.entropy_coef > 0)
        kl_loss = r.kl_in == "loss" and "reference" in self.all_roles
        kl_coef = self.kl_ctl.value if kl_loss else 0.0

        def loss_fn(batch, logits):
            logp, entropy = logprobs(batch, logits)
            return A.ppo_policy_loss(
                logp, batch["old_logp"], batch["advantages"], batch["mask"], clip_low=r.clip_low,
                clip_high=r.clip_high, dual_clip=r.dual_clip, agg=r.loss_agg, entropy=entropy,
                entropy_coef=r.entropy_coef, ref_logp=batch.get("ref_logp") if kl_loss else None,
                kl_coef=kl_coef, kl_kind=r.kl_estimator, max_len=r.max_new_tokens)

        return loss_fn

    def _value_loss(self):
        r = self.cfg.rl

        def loss_fn(batch, values):
            v = values.squeeze(-1)
            loss_sum, count, metrics = A.value_loss(v, batch["values"], batch["returns"], batch["mask"],
                                                    clip=r.value_clip)
            m = batch["mask"].float()
            ev = torch.stack([((v.detach().float() - batch["returns"]) ** 2 * m).sum().double(), m.sum().double()])
            metrics["value_sq_err"] = ev
            return loss_sum, count, metrics

        return loss_fn

    # -- updates --------------------------------------------------------------------------------

    def _train(self, role: Role, exp: Experience, loss_fn, step: int, prefix: str) -> dict:
        """ppo_epochs x mini_batches optimizer steps over this step's rows (see minibatch_rows)."""
        r = self.cfg.rl
        n = exp.tokens.shape[0]
        sums: dict = {}
        for epoch in range(r.ppo_epochs):
            assignment = minibatch_rows(n, self.dp_rank * n, r.mini_batches,
                                        (self.cfg.train.seed, step, epoch))
            for k, rows in enumerate(assignment):
                plan = plan_microbatches([exp.lengths[i] for i in rows], max_rows=r.micro_batch_size,
                                         max_tokens=r.max_tokens_per_micro_batch)
                mbs = [exp.microbatch([rows[i] for i in grp]) for grp in plan]
                result = role.train_step(mbs, loss_fn, skip_nonfinite=True)
                for key, v in {**result.metrics, "grad_norm": result.grad_norm, "lr": result.lr,
                               "skipped_steps": float(result.skipped)}.items():
                    if epoch == 0 and k == 0 and key in ("ratio", "clip_fraction", "approx_kl"):
                        sums.setdefault(f"{key}_first_minibatch", []).append(v)
                    sums.setdefault(key, []).append(v)
        out = {f"{prefix}/{k}": (sum(v) if k == "skipped_steps" else sum(v) / len(v)) for k, v in sums.items()}
        if prefix == "critic":
            mse = out.pop("critic/value_sq_err", None)
            m = exp.mask.double()
            ret = exp.returns.double()
            s = dp_sum(torch.stack([(ret * m).sum(), (ret ** 2 * m).sum(), m.sum()]))
            var = s[1] / s[2] - (s[0] / s[2]) ** 2
            if mse is not None and var > 0:
                out["critic/explained_variance"] = 1.0 - mse / var.item()
        return out

    def _skip(self, step: int, why: str) -> dict:
        self.nonfinite_in_a_row += 1
        log.warning("rl step %d skipped: %s (%d in a row)", step + 1, why, self.nonfinite_in_a_row)
        if self.nonfinite_in_a_row >= self.cfg.rl.max_nonfinite_steps:
            raise StageStopped(f"rl: {self.nonfinite_in_a_row} steps in a row had a {why}; stopping "
                               "(the last good checkpoint is kept); lower optim.lr or check the reward function")
        return {"train/skipped_steps": 1.0, **{k: v for k, v in self.metrics.items() if k.startswith("memory/")}}

    def _check_kl_ceiling(self, kl: float, step: int) -> None:
        r = self.cfg.rl
        if r.kl_ceiling is None:
            return
        self.kl_over_ceiling = self.kl_over_ceiling + 1 if kl > r.kl_ceiling else 0
        if self.kl_over_ceiling >= r.kl_ceiling_steps:
            raise StageStopped(f"rl: KL to the reference ({kl:.4g}) stayed above rl.kl_ceiling ({r.kl_ceiling}) "
                               f"for {self.kl_over_ceiling} steps (step {step + 1}); stopping with the last good "
                               "checkpoint kept: lower optim.lr or raise rl.kl_coef")

    def _timings(self, timings: dict, rollout) -> dict:
        names = list(timings)
        out = {}
        for a, b in zip(names, names[1:]):
            out[f"perf/{a}_s"] = timings[b] - timings[a]
        new_tokens = float(rollout.response_lens.sum()) * self.dp_size
        if "perf/generate_s" in out:
            out["perf/generate_tokens_per_s"] = new_tokens / max(out["perf/generate_s"], 1e-9)
        return out

    # -- evaluation and state ---------------------------------------------------------------------

    def evaluate(self, step: int):
        from megarl.trainers.evaluate import pass_at_k_eval

        r = self.cfg.rl
        self.phases.enter("generate")
        return pass_at_k_eval(self.engine, self.eval_ds, self.tok, n_prompts=r.eval_prompts, k=r.eval_samples,
                              params=self._sampling(r.eval_temperature, r.eval_samples),
                              seed=_mix(self.cfg.train.seed, 99991), reward_fn=self.eval_reward_fn)

    @property
    def evaluate_first(self) -> bool:
        return self.cfg.rl.eval_before_train

    @property
    def has_evaluation(self) -> bool:
        return self.eval_ds is not None and self.cfg.rl.eval_prompts > 0

    def state_dict(self) -> dict:
        return {"prompts": self.prompts.state_dict(), "kl_ctl": self.kl_ctl.state_dict(),
                "nonfinite_in_a_row": self.nonfinite_in_a_row, "kl_over_ceiling": self.kl_over_ceiling}

    def load_state_dict(self, state: dict) -> None:
        self.prompts.load_state_dict(state["prompts"])
        self.kl_ctl.load_state_dict(state["kl_ctl"])
        self.nonfinite_in_a_row = state["nonfinite_in_a_row"]
        self.kl_over_ceiling = state["kl_over_ceiling"]


def minibatch_rows(n_local: int, offset: int, mini_batches: int, key: tuple) -> list[list[int]]:
    """This rank's local rows of each mini-batch, the same global mini-batches at any DP size.

    Global rows (offset + local index) fall in blocks of `mini_batches` consecutive rows; each
    block sends one row to every mini-batch, by a permutation keyed by (key, block). Every rank
    holds whole blocks, so each mini-batch is balanced over ranks, differs from epoch to epoch
    (key holds the epoch), and is the same set of rows whatever the DP size: the step then
    equals the single-process step (verl and OpenRLHF shuffle per rank instead).
    """
    import numpy as np

    m = mini_batches
    if n_local % m or offset % m:
        raise ConfigError(f"rl.mini_batches ({m}) must divide the rows per DP rank ({n_local})")
    out: list[list[int]] = [[] for _ in range(m)]
    for j in range(0, n_local, m):
        perm = np.random.default_rng([*key, (offset + j) // m]).permutation(m)
        for pos in range(m):
            out[perm[pos]].append(j + pos)
    return out


def _mix(*values: int) -> int:
    """A 62-bit seed from integers (splitmix-style), the same on every rank."""
    h = 0x9E3779B97F4A7C15
    for v in values:
        h = (h ^ (int(v) & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        h ^= h >> 31
    return h & ((1 << 62) - 1)


def build_stage(cfg: Config, stage_dir: str) -> RLStage:
    return RLStage(cfg, stage_dir)


def main(cfg: Config) -> dict:
    return train_stage(cfg, STAGE, build_stage)
