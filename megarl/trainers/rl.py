"""RL stage: PPO (critic + GAE), GRPO, RLOO, REINFORCE and REINFORCE++ on colocated roles.

    megarl rl --config configs/tiny_grpo.yaml [key=value ...]

One loop step, top to bottom (`RLStage.step`); each phase takes the previous one's data and
returns its own metrics:
  1. generate:   this DP rank's prompts x n samples with the rollout engine on the actor (tool
                 calls run inside responses, their observations masked out of every loss), and
                 their rewards (rule and/or reward model); with rl.dynamic_sampling, further
                 prompts until `prompts_per_step` groups carry a signal (DAPO);
  2. score:      old log-probs (actor), reference log-probs, values (critic);
  3. advantages: the algorithm's estimator (algorithms/spec.py says which, and its whitening);
  4. train:      critic, then actor, `ppo_epochs` x `mini_batches` optimizer steps each.
Each role is resident only in its phases (`with clock.phase(name)`). The algorithms are pure
functions in `megarl.algorithms`; this file moves tensors between them and the roles. Roles:
actor and critic train (checkpointed with optimizer state); the reference and the reward model
are frozen and rebuilt from where they came from on resume (trainers/weights.py).
"""
from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass, fields, replace

import torch

from megarl import algorithms as A
from megarl.config import Config, ConfigError
from megarl.config.schema import role_config
from megarl.models import moe
from megarl.models.gpt import HeadStates, mask_padded_vocab
from megarl.models.lora import adapters_disabled
from megarl.ops import IGNORE_INDEX, head_token_loss
from megarl.roles import offload
from megarl.roles.microbatch import MicroBatch
from megarl.roles.phases import PhaseClock, PhaseScheduler
from megarl.roles.role import Role
from megarl.runtime.distributed import dp_gather_objects, dp_group, dp_max, dp_means
from megarl.trainers import data_setup
from megarl.trainers.common import mix_seed, padding_waste, plan_microbatches
from megarl.trainers.evaluate import eval_sampling, pass_at_k_eval, rl_sampling, rollout_engine, tool_metric_pairs
from megarl.trainers.loop import Stage, train_stage
from megarl.trainers.stops import StageStopped
from megarl.trainers.weights import build_roles, lora_reference

log = logging.getLogger("megarl")

STAGE = "rl"
ACCURACY_REWARDS = ("final_answer", "gsm8k", "exact_match")  # 0/1 rewards: their mean is an accuracy


# ---------------------------------------------------------------------------------------------
# Experience: one step's rollouts on this DP rank as training tensors


@dataclass
class Experience:
    """Row i is one prompt + response, right-padded; column t predicts token t + 1."""

    tokens: torch.Tensor       # [N, L] long
    labels: torch.Tensor       # [N, L] long: tokens shifted left (pad at the end)
    mask: torch.Tensor         # [N, L] bool: True where labels[t] is a response token the policy sampled
    #                            (tool observations inside a response are False: no log-prob, no loss)
    prompt_lens: torch.Tensor  # [N] long
    lengths: list              # [N] prompt + response length: the columns a row needs
    stopped: torch.Tensor      # [N] bool: ended on a stop token (False: cut at max_new_tokens)
    rollout_logp: torch.Tensor  # [N, L] fp32: the sampled distribution's log-probs, in label columns
    scores: torch.Tensor       # [N] fp32 sequence reward (rule + reward model + shaping)
    old_logp: torch.Tensor | None = None  # [N, L] fp32
    ref_logp: torch.Tensor | None = None
    values: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    is_weight: torch.Tensor | None = None  # [N, L] fp32: rl.rollout_correction=tis's per-token weights
    routing: torch.Tensor | None = None  # [N, L, layers, k] int16: the rollout's experts per token (MoE)

    def microbatch(self, rows: list[int], hidden: bool = False, routing: bool = False) -> MicroBatch:
        """Rows `rows`, cut to their longest sequence, as a Role micro-batch.

        The model's head runs only from the first column that predicts a response token
        (`output_from`: no logits for the prompt prefix the rows share), so every per-token
        field is given from that column on: [b, width - output_from]. hidden: an LM role returns
        its final hidden states and output weight instead of logits (`return_hidden`), for the
        fused head op. routing: the model replays the rollout's experts (rl.routing_replay)."""
        width = max(self.lengths[i] for i in rows)
        idx = torch.tensor(rows)
        first = int(self.prompt_lens[idx].min()) - 1  # earliest column predicting a response token
        data = {"labels": self.labels[idx, first:width], "mask": self.mask[idx, first:width]}
        for name in ("old_logp", "ref_logp", "values", "advantages", "returns", "is_weight"):
            value = getattr(self, name)
            if value is not None:
                data[name] = value[idx, first:width]
        return MicroBatch(self.tokens[idx, :width], torch.arange(width).expand(len(rows), width), data,
                          output_from=first, return_hidden=hidden,
                          routing=self.routing[idx, :width] if routing and self.routing is not None else None)

    def rows(self, rows: list[int]) -> "Experience":
        idx = torch.tensor(rows, dtype=torch.long)
        return replace(self, lengths=[self.lengths[i] for i in rows],
                       **{f.name: getattr(self, f.name)[idx] for f in fields(self)
                          if isinstance(getattr(self, f.name), torch.Tensor)})

    @staticmethod
    def cat(parts: list["Experience"], pad_id: int) -> "Experience":
        """Rows of `parts` in order; per-token tensors right-padded to the widest part."""
        width = max(p.tokens.shape[1] for p in parts)

        def widen(t, fill):  # [N, L, ...] -> [N, width, ...]
            return torch.cat([t, t.new_full((t.shape[0], width - t.shape[1], *t.shape[2:]), fill)], 1) if t.dim() > 1 else t

        out = {}
        for f in fields(Experience):
            values = [getattr(p, f.name) for p in parts]
            if f.name == "lengths":
                out[f.name] = [x for v in values for x in v]
            elif any(v is None for v in values):
                out[f.name] = None
            else:
                fill = pad_id if f.name in ("tokens", "labels") else -1 if f.name == "routing" else 0
                out[f.name] = torch.cat([widen(v, fill) for v in values])
        return Experience(**out)


def experience_from_rollout(rollout, pad_id: int) -> Experience:
    tokens = rollout.tokens  # [N, L]
    n, width = tokens.shape
    labels = torch.full_like(tokens, pad_id)
    labels[:, :-1] = tokens[:, 1:]
    cols = torch.arange(width)
    first = rollout.prompt_lens - 1  # column predicting the first response token
    response = (cols >= first[:, None]) & (cols < (first + rollout.response_lens)[:, None])  # [N, L]
    mask = torch.zeros_like(response)
    mask[response] = rollout.sampled_mask[rollout.response_mask]  # observations (forced tokens) off
    rollout_logp = torch.zeros(tokens.shape, dtype=torch.float32)
    rollout_logp[response] = rollout.logprobs[rollout.response_mask]  # 0 at observations
    lengths = (rollout.prompt_lens + rollout.response_lens).tolist()
    return Experience(tokens, labels, mask, rollout.prompt_lens.clone(), lengths, rollout.stopped.clone(),
                      rollout_logp, torch.zeros(n), routing=rollout.routing)


# ---------------------------------------------------------------------------------------------
# Per-token quantities from a role's output (run on the last pipeline stage)


def _token_logprobs(vocab_size: int, temperature: float, with_entropy: bool = False):
    """(log p(labels), entropy or None) [b, s] from an LM role's output: the fused head op on its
    hidden states (rl.fused_head: no [tokens, V] logits, forward or backward), or its logits."""
    from megatron.core import parallel_state as ps

    from megarl.models.gpt import HeadStates
    from megarl.ops import IGNORE_INDEX, head_logprobs, logprobs_and_entropy

    def fn(batch, output):
        labels, mask = batch["labels"], batch["mask"]
        # tokens no loss reads (padding, observations) get log-prob 0 and no gradient; the fused
        # head leaves them out of its GEMMs
        labels = labels.masked_fill(~mask, IGNORE_INDEX)
        if isinstance(output, HeadStates):  # hidden [b, s, h] + the output weight
            logp, entropy = head_logprobs(output, labels, temperature=temperature, with_entropy=with_entropy)
        else:
            logits = mask_padded_vocab(output, vocab_size)  # [b, s, V_pad/tp]
            logp, entropy = logprobs_and_entropy(logits, labels, tp_group=ps.get_tensor_model_parallel_group(),
                                                 temperature=temperature, with_entropy=with_entropy)
        return logp, entropy

    return fn


def collect_per_token(role: Role, exp: Experience, groups: list[list[int]], fn, hidden: bool = False,
                      routing: bool = False) -> torch.Tensor:
    """A [N, L] fp32 tensor from `fn(batch, output) -> [b, s]` over every micro-batch (forward only)."""
    mbs = [exp.microbatch(g, hidden, routing) for g in groups]
    out = torch.zeros(exp.tokens.shape, dtype=torch.float32)
    for g, mb, part in zip(groups, mbs, role.forward_collect(mbs, lambda b, o: fn(b, o).float().cpu())):
        out[torch.tensor(g), mb.output_from: mb.output_from + part.shape[1]] = part
    return out


# ---------------------------------------------------------------------------------------------
# The stage


class RLStage(Stage):
    def __init__(self, cfg: Config, stage_dir: str):
        from megatron.core import parallel_state as ps

        from megarl.data import DataIterator
        from megarl.rewards import load_reward_fn

        self.cfg, r = cfg, cfg.rl
        self.name = STAGE
        self.spec = A.algorithm(r.algorithm)
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
        # the KL's reference: its own role, or the LoRA actor with its adapters off (no second model)
        self.reference = self.actor if lora_reference(cfg) else self.all_roles.get("reference")
        self.engine = rollout_engine(cfg, self.actor, self.tok)
        self.engine.record_routing = bool(cfg.model.moe.num_experts)  # replay, or its agreement metric
        self.reward_fn = load_reward_fn(r.reward_fn) if r.reward_fn else None
        self.eval_reward_fn = load_reward_fn(r.eval_reward_fn)
        if r.kl_target is not None:
            self.kl_ctl = A.AdaptiveKLController(r.kl_coef, r.kl_target, r.kl_horizon)
        else:
            self.kl_ctl = A.FixedKLController(r.kl_coef)
        self.nonfinite_in_a_row = 0
        self.kl_over_ceiling = 0
        self.agreement = None  # (same, compared) (token, layer) routings of the last scoring, MoE only
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
        if self.reference is self.actor:
            plan["score_reference"] = {"actor": ["params"]}
        if "critic" in names:
            plan["score_critic"] = {"critic": ["params"]}
            plan["train_critic"] = {"critic": "all"}
        return plan

    # -- one loop step ------------------------------------------------------------------------

    def step(self, step: int) -> dict:
        clock = PhaseClock(self.phases)
        exp, metrics = self.generate(step, clock)             # 1. samples and their rewards
        groups = self.score(exp, clock)                         # 2. log-probs and values
        if self.agreement is not None:  # MoE without routing replay: did training route as the rollout did?
            metrics["moe/routing_agreement"] = dp_means({"a": self.agreement})["a"]
        metrics.update(self.advantages(exp, groups, clock))     # 3.
        if not metrics.pop("finite"):
            return self._skip(step, "non-finite reward or advantage", clock)
        metrics.update(self.train(exp, step, clock))            # 4. critic, then actor
        skipped, total = metrics["actor/skipped_minibatches"], metrics.pop("actor/minibatches")
        if skipped == total:
            return self._skip(step, "non-finite loss", clock)
        if skipped:  # some updates applied: keep the step's figures, but count it towards stopping
            self._count_nonfinite(step, f"non-finite loss in {skipped:.0f} of {total} actor mini-batches")
        else:
            self.nonfinite_in_a_row = 0
        r = self.cfg.rl
        self.kl_ctl.update(metrics.get("kl/mean", 0.0), r.prompts_per_step * r.samples_per_prompt)
        self._check_kl_ceiling(metrics.get("kl/mean", 0.0), step)
        metrics["train/kl_coef"] = self.kl_ctl.value
        metrics.update(clock.metrics())
        metrics["perf/generate_tokens_per_s"] = metrics.pop("rollout/generated_tokens") / max(
            metrics["perf/generate_s"], 1e-9)
        metrics.update(self.phases.ledger.metrics("memory/"))
        for name, usage in self.phases.ledger.cuda.items():  # the allocator's own peak per phase
            metrics[f"memory/{name}_cuda_peak_gib"] = usage["peak"] / 2**30
        return metrics

    # 1. generate ------------------------------------------------------------------------------

    def generate(self, step: int, clock: PhaseClock) -> tuple[Experience, dict]:
        """This rank's prompts_per_step / dp groups of samples with their scores, and the
        rollout and reward metrics. With rl.dynamic_sampling, groups whose rewards are all
        equal are replaced by groups of further prompts (up to max_resample_rounds generations)."""
        r = self.cfg.rl
        rounds = r.max_resample_rounds if r.dynamic_sampling else 1
        parts, signals, reward_pairs, generated_tokens = [], [], {}, 0
        for k in range(rounds):
            batch = next(self.prompts)
            params = rl_sampling(r, self.tok.stop_ids, r.samples_per_prompt, r.temperature)
            rows_per_rank = len(batch["prompt_ids"]) * r.samples_per_prompt
            seed = mix_seed(self.cfg.train.seed, step) if k == 0 else mix_seed(self.cfg.train.seed, step, k)
            with clock.phase("generate"):
                rollout = self.engine.generate(batch["prompt_ids"], params, seed=seed,
                                               sample_offset=self.dp_rank * rows_per_rank)
                offload.report_workspaces(self.actor)  # the decode workspace's bytes into the ledger
            generated_tokens += float(rollout.response_lens.sum()) * self.dp_size
            if self.engine.tools is not None:  # calls, failures, observation tokens per sample
                for name, (total, count) in tool_metric_pairs(rollout).items():
                    _add(reward_pairs, f"tools/{name}", total, count)
            exp = experience_from_rollout(rollout, self.tok.pad_id)
            exp.scores = self._rewards(exp, batch, rollout, clock, reward_pairs)
            parts.append(exp)
            if r.dynamic_sampling:
                signals.append(self._signal(exp))
                if sum(map(sum, signals)) >= r.prompts_per_step:
                    break
        metrics = dp_means(reward_pairs)
        metrics["reward/std"] = math.sqrt(max(metrics.pop("reward/sq_mean") - metrics["reward/mean"] ** 2, 0.0))
        if r.dynamic_sampling:
            exp, sampling = self._groups_with_signal(parts, signals)
            metrics.update(sampling)
        resp = (torch.tensor(exp.lengths) - exp.prompt_lens).double()
        metrics.update(dp_means({"rollout/response_len_mean": (resp.sum(), len(resp)),
                                 "rollout/prompt_len_mean": (exp.prompt_lens.double().sum(), len(resp)),
                                 "rollout/stopped_fraction": (exp.stopped.double().sum(), len(resp))}))
        metrics["rollout/response_len_max"] = dp_max(float(resp.max()))
        metrics["rollout/generated_tokens"] = generated_tokens
        return exp, metrics

    def _rewards(self, exp: Experience, batch: dict, rollout, clock: PhaseClock, pairs: dict) -> torch.Tensor:
        """Sequence scores: rule reward + coef x reward model at the last response token, plus
        DAPO's overlong penalty; `pairs` collects the reward metrics (sum, count) of every round."""
        from megarl.rewards import score_batch

        r = self.cfg.rl
        n = r.samples_per_prompt
        scores = torch.zeros(exp.tokens.shape[0], dtype=torch.float32)
        if self.reward_fn is not None:
            with clock.timed("score_rule"):
                answers = [a for a in batch["answers"] for _ in range(n)]
                prompts_text = [m[-1]["content"] for m in batch["messages"] for _ in range(n)]
                responses = [self.tok.decode(ids, skip_special_tokens=True) for ids in rollout.responses()]
                result = score_batch(self.reward_fn, prompts_text, responses, answers,
                                     max_fail_fraction=r.max_reward_failures)
            rule = torch.tensor(result.scores, dtype=torch.float32)
            scores += rule
            _add(pairs, "reward/rule_mean", rule.double().sum(), len(rule))
            _add(pairs, "reward/failed_fraction", float(result.n_failed), len(rule))
            if r.reward_fn in ACCURACY_REWARDS:
                _add(pairs, "reward/accuracy", (rule > 0).double().sum(), len(rule))
        if "reward" in self.all_roles:
            with clock.phase("score_reward"):
                values = collect_per_token(self.all_roles["reward"], exp, self._plan(exp),
                                           lambda b, o: o.squeeze(-1))
            rm = A.sequence_reward(values, exp.prompt_lens, torch.tensor(exp.lengths) - 1,
                                   self.all_roles["reward"].reward_pooling or "last")
            scores += r.reward_model_coef * rm
            _add(pairs, "reward/model_mean", rm.double().sum(), len(rm))
        if r.overlong == "soft":
            penalty = A.overlong_penalty(rollout.response_lens, r.max_new_tokens, r.overlong_buffer,
                                         r.overlong_penalty)
            scores += penalty
            _add(pairs, "reward/overlong_penalty_mean", penalty.double().sum(), len(penalty))
        scores = A.clip_rewards(scores, r.reward_clip)
        _add(pairs, "reward/mean", scores.double().sum(), len(scores))
        _add(pairs, "reward/sq_mean", (scores.double() ** 2).sum(), len(scores))
        return scores

    def _signal(self, exp: Experience) -> list[bool]:
        """Per group of every DP rank, in global order: do its rewards differ?"""
        local = A.groups_with_signal(exp.scores, self.cfg.rl.samples_per_prompt).tolist()
        return [s for rank in dp_gather_objects(local) for s in rank]

    def _groups_with_signal(self, parts: list[Experience], signal: list[list[bool]]) -> tuple[Experience, dict]:
        """DAPO's dynamic sampling: the first prompts_per_step groups with signal over all rounds
        (signal[round][global group], from _signal; global order: round, DP rank, group), filled up with groups without signal in the same
        order if too few; spread over DP ranks as one round's groups are, so the step is the same
        at any DP size. Only the chosen groups' rows move between ranks."""
        r = self.cfg.rl
        n, want = r.samples_per_prompt, r.prompts_per_step
        per_rank = want // self.dp_size  # groups per DP rank, in every round
        order = [(k, g) for k in range(len(parts)) for g in range(want) if signal[k][g]]
        with_signal = len(order)
        order += [(k, g) for k in range(len(parts)) for g in range(want) if not signal[k][g]]
        chosen = order[:want]
        mine = {}  # (round, global group) -> this rank's rows of it, for the chosen groups it holds
        for k, g in chosen:
            if g // per_rank == self.dp_rank:
                local = g % per_rank
                mine[(k, g)] = parts[k].rows(list(range(local * n, (local + 1) * n)))
        held = {key: part for rank in dp_gather_objects(mine) for key, part in rank.items()}
        share = chosen[self.dp_rank * per_rank:(self.dp_rank + 1) * per_rank]
        exp = Experience.cat([held[key] for key in share], self.tok.pad_id)
        generated = len(parts) * want
        return exp, {"rollout/filtered_fraction": 1.0 - with_signal / generated,
                     "rollout/sampling_rounds": float(len(parts)),
                     "rollout/filled_groups": float(max(0, want - with_signal))}

    # 2. score ---------------------------------------------------------------------------------

    def score(self, exp: Experience, clock: PhaseClock) -> list[list[int]]:
        """Old log-probs (recomputed or the rollout's), reference log-probs, values; returns the
        micro-batch plan of these rows."""
        r = self.cfg.rl
        groups = self._plan(exp)
        logprobs = _token_logprobs(self.cfg.model.vocab_size, r.temperature)
        fused = r.fused_head
        replay = r.routing_replay == "rollout"
        if r.old_logprobs == "rollout":  # the sampled distribution's own log-probs
            exp.old_logp = exp.rollout_logp
        else:
            with clock.phase("score_actor"), self._routing_agreement(exp, groups):
                exp.old_logp = collect_per_token(self.actor, exp, groups, lambda b, o: logprobs(b, o)[0], fused,
                                                 replay)
        if self.reference is not None:
            off = adapters_disabled(self.actor.model) if self.reference is self.actor else contextlib.nullcontext()
            with clock.phase("score_reference"), off:
                exp.ref_logp = collect_per_token(self.reference, exp, groups, lambda b, o: logprobs(b, o)[0], fused,
                                                 replay)
        if "critic" in self.all_roles:
            with clock.phase("score_critic"):
                exp.values = collect_per_token(self.all_roles["critic"], exp, groups, lambda b, o: o.squeeze(-1))
        return groups

    @contextlib.contextmanager
    def _routing_agreement(self, exp: Experience, groups: list[list[int]]):
        """Without replay: record the actor's experts in the block's forwards (one per micro-batch
        of `groups`) and set `self.agreement` to the share of (token, layer) pairs routed to the
        same experts as in the rollout (this pipeline stage's layers)."""
        self.agreement = None
        if exp.routing is None or self.cfg.rl.routing_replay != "none":
            yield
            return
        with moe.recording(self.actor.model) as routers:
            yield
        same = seen = 0
        for call, rows in enumerate(groups):
            width = max(exp.lengths[i] for i in rows)
            got = moe.recorded(routers, call).view(width, len(rows), len(routers), -1).transpose(0, 1)
            a, n = moe.agreement(got.cpu(), exp.routing[torch.tensor(rows), :width].long())
            same, seen = same + a, seen + n
        self.agreement = (same, seen)

    def _plan(self, exp: Experience, rows: list[int] | None = None) -> list[list[int]]:
        """Micro-batches of exp's rows `rows` (default all), as lists of row indices."""
        r = self.cfg.rl
        rows = list(range(len(exp.lengths))) if rows is None else rows
        plan = plan_microbatches([exp.lengths[i] for i in rows], max_rows=r.micro_batch_size,
                                 max_tokens=r.max_tokens_per_micro_batch)
        return [[rows[j] for j in g] for g in plan]

    # 3. advantages ----------------------------------------------------------------------------

    def advantages(self, exp: Experience, groups: list[list[int]], clock: PhaseClock) -> dict:
        """exp.advantages (and exp.returns) by the algorithm's spec; metrics, with "finite":
        whether every reward and advantage of every DP rank is finite."""
        r = self.cfg.rl
        metrics = {}
        with clock.timed("advantages"):
            mask = exp.mask
            kl = None
            if exp.ref_logp is not None:
                kl = A.kl_estimate(exp.old_logp, exp.ref_logp, r.kl_estimator) * mask
                metrics.update(dp_means({"kl/mean": (kl.double().sum(), mask.sum())}))
            penalty = self.kl_ctl.value * kl if (kl is not None and r.kl_in == "reward") else None
            settings = A.AdvantageSettings(group_size=r.samples_per_prompt, gamma=r.gamma, lam=r.lam,
                                           scale_by_std=r.scale_by_std)
            exp.advantages, exp.returns = A.compute_advantages(
                self.spec, exp.scores, mask, settings, kl_penalty=penalty, values=exp.values,
                whiten_advantages=r.whiten_advantages, group=dp_group())
            if exp.returns is not None:
                metrics.update(dp_means({"critic/returns_mean": ((exp.returns.double() * mask).sum(), mask.sum())}))
                ev = float(A.explained_variance(exp.values, exp.returns, mask, group=dp_group()))
                if math.isfinite(ev):  # NaN when the returns do not vary
                    metrics["critic/explained_variance"] = ev
            if r.overlong == "filter":  # responses cut at max_new_tokens leave the loss
                exp.mask = mask & exp.stopped[:, None]
                exp.advantages = exp.advantages * exp.mask
            if r.old_logprobs == "recompute":  # the engine's log-probs against the trainer's
                metrics.update(self._rollout_mismatch(exp, mask))
            bad = not (bool(torch.isfinite(exp.scores).all()) and bool(torch.isfinite(exp.advantages).all()))
        waste = padding_waste(exp.lengths, groups)
        metrics.update(dp_means({"train/padding_waste": (waste * len(groups), len(groups))}))
        metrics["finite"] = dp_max(float(bad)) == 0
        return metrics

    def _rollout_mismatch(self, exp: Experience, sampled: torch.Tensor) -> dict:
        """mismatch/* over the sampled tokens, then rl.rollout_correction: tis sets exp.is_weight,
        mis takes the rows out of the loss (the critic's too, as rl.overlong=filter does)."""
        r = self.cfg.rl
        pairs, abs_max = A.mismatch_metrics(exp.old_logp, exp.rollout_logp, sampled, r.rollout_correction_c)
        metrics = {f"mismatch/{k}": (v[0], v[1]) for k, v in pairs.items()}
        if r.rollout_correction == "tis":
            exp.is_weight = A.tis_weights(exp.old_logp, exp.rollout_logp, exp.mask, r.rollout_correction_c)
            metrics["mismatch/tis_weight_mean"] = (exp.is_weight.double().sum(), exp.mask.sum())
        elif r.rollout_correction == "mis":
            keep = A.mis_keep(exp.old_logp, exp.rollout_logp, exp.mask, r.rollout_correction_lo,
                              r.rollout_correction_hi)
            rows = exp.mask.any(1)
            metrics["mismatch/mis_masked_fraction"] = ((rows & ~keep).sum(), rows.sum())
            exp.mask = exp.mask & keep[:, None]
            exp.advantages = exp.advantages * exp.mask
        out = dp_means(metrics)
        out["mismatch/logp_abs_diff_max"] = dp_max(float(abs_max))
        return out

    # 4. train ---------------------------------------------------------------------------------

    def train(self, exp: Experience, step: int, clock: PhaseClock) -> dict:
        """Critic first (on the values the actor's advantages were built from), then actor."""
        metrics = {}
        if "critic" in self.all_roles:
            with clock.phase("train_critic"):
                metrics.update(self._train(self.all_roles["critic"], exp, self._value_loss(), step, "critic"))
        with clock.phase("train_actor"):
            metrics.update(self._train(self.actor, exp, self._policy_loss(), step, "actor",
                                       hidden=self.cfg.rl.fused_head))
        return metrics

    def _policy_loss(self):
        r = self.cfg.rl
        logprobs = _token_logprobs(self.cfg.model.vocab_size, r.temperature, with_entropy=r.entropy_coef > 0)
        kl_loss = r.kl_in == "loss" and self.reference is not None
        kl_coef = self.kl_ctl.value if kl_loss else 0.0

        clip = dict(clip_low=r.clip_low, clip_high=r.clip_high, dual_clip=r.dual_clip, entropy_coef=r.entropy_coef,
                    kl_coef=kl_coef, kl_kind=r.kl_estimator)

        def loss_fn(batch, output):
            if isinstance(output, HeadStates) and torch.is_grad_enabled():
                return fused_loss(batch, output)
            logp, entropy = logprobs(batch, output)
            return A.ppo_policy_loss(
                logp, batch["old_logp"], batch["advantages"], batch["mask"], agg=r.loss_agg, entropy=entropy,
                ref_logp=batch.get("ref_logp") if kl_loss else None, max_len=r.max_new_tokens,
                is_weight=batch.get("is_weight"), **clip)

        def fused_loss(batch, head):
            """The same loss, its gradient taken inside the output layer (ops.head_token_loss):
            each token's loss depends on its own log-prob and entropy, weighted by the aggregation."""
            mask = batch["mask"]
            labels = batch["labels"].masked_fill(~mask, IGNORE_INDEX)
            names = ("old_logp", "advantages") + (("ref_logp",) if kl_loss else ()) + (
                ("is_weight",) if "is_weight" in batch else ())
            flat = {k: batch[k].reshape(-1).float() for k in names}  # [b s'] per-token constants
            flat["weight"] = A.token_weights(mask, r.loss_agg, r.max_new_tokens).reshape(-1)

            def token_loss(pos, lp, ent):  # pos [c]: the chunk's tokens; lp, ent [c]
                per_token, _ = A.ppo_token_loss(
                    lp, flat["old_logp"][pos], flat["advantages"][pos], entropy=ent,
                    ref_logp=flat["ref_logp"][pos] if kl_loss else None,
                    is_weight=flat["is_weight"][pos] if "is_weight" in flat else None, **clip)
                return (per_token * flat["weight"][pos]).sum()

            loss_sum, logp, entropy = head_token_loss(head, labels, token_loss, temperature=r.temperature,
                                                      with_entropy=r.entropy_coef > 0)
            with torch.no_grad():  # the metrics, from the same log-probs
                _, count, metrics = A.ppo_policy_loss(
                    logp, batch["old_logp"], batch["advantages"], batch["mask"], agg=r.loss_agg, entropy=entropy,
                    ref_logp=batch.get("ref_logp") if kl_loss else None, max_len=r.max_new_tokens,
                    is_weight=batch.get("is_weight"), **clip)
            metrics["loss"] = torch.stack([loss_sum.detach().double(), count.double()])
            return loss_sum, count, metrics

        return loss_fn

    def _value_loss(self):
        r = self.cfg.rl
        return lambda batch, values: A.value_loss(values.squeeze(-1), batch["values"],
                                                  batch["returns"], batch["mask"], clip=r.value_clip)

    def _train(self, role: Role, exp: Experience, loss_fn, step: int, prefix: str, hidden: bool = False) -> dict:
        """ppo_epochs x mini_batches optimizer steps over this step's rows (see minibatch_rows).
        Metrics are means over the optimizer steps; skipped_minibatches counts the steps dropped
        for a non-finite loss."""
        r = self.cfg.rl
        n = exp.tokens.shape[0]
        sums: dict = {}
        skipped = 0
        replay = r.routing_replay == "rollout" and role is not self.all_roles.get("critic")
        for epoch in range(r.ppo_epochs):
            assignment = minibatch_rows(n, self.dp_rank * n, r.mini_batches, (self.cfg.train.seed, step, epoch))
            for k, rows in enumerate(assignment):
                plan = self._plan(exp, rows)
                mbs = [exp.microbatch(grp, hidden, routing=replay) for grp in plan]
                result = role.train_step(mbs, loss_fn, skip_nonfinite=True)
                skipped += int(result.skipped)
                for key, v in {**result.metrics, "grad_norm": result.grad_norm, "lr": result.lr}.items():
                    if epoch == 0 and k == 0 and key in ("ratio", "clip_fraction", "approx_kl"):
                        sums.setdefault(f"{key}_first_minibatch", []).append(v)
                    sums.setdefault(key, []).append(v)
        out = {f"{prefix}/{k}": sum(v) / len(v) for k, v in sums.items()}
        out[f"{prefix}/skipped_minibatches"] = float(skipped)
        out[f"{prefix}/minibatches"] = r.ppo_epochs * r.mini_batches
        if prefix == "critic":
            out.pop("critic/minibatches")
        return out

    # -- stopping ---------------------------------------------------------------------------------

    def _count_nonfinite(self, step: int, why: str) -> None:
        self.nonfinite_in_a_row += 1
        log.warning("rl step %d: %s (%d in a row)", step + 1, why, self.nonfinite_in_a_row)
        if self.nonfinite_in_a_row >= self.cfg.rl.max_nonfinite_steps:
            raise StageStopped(f"rl: {self.nonfinite_in_a_row} steps in a row had a {why}; stopping "
                               "(the last good checkpoint is kept); lower optim.lr or check the reward function")

    def _skip(self, step: int, why: str, clock: PhaseClock) -> dict:
        """A step with no update applied: counted towards stopping, only its memory figures logged."""
        self._count_nonfinite(step, f"{why}, skipped")
        memory = {k: v for k, v in clock.metrics().items() if k.startswith("memory/")}
        return {"train/skipped_steps": 1.0, **memory}

    def _check_kl_ceiling(self, kl: float, step: int) -> None:
        r = self.cfg.rl
        if r.kl_ceiling is None:
            return
        self.kl_over_ceiling = self.kl_over_ceiling + 1 if kl > r.kl_ceiling else 0
        if self.kl_over_ceiling >= r.kl_ceiling_steps:
            raise StageStopped(f"rl: KL to the reference ({kl:.4g}) stayed above rl.kl_ceiling ({r.kl_ceiling}) "
                               f"for {self.kl_over_ceiling} steps (step {step + 1}); stopping with the last good "
                               "checkpoint kept: lower optim.lr or raise rl.kl_coef")

    # -- evaluation and state ---------------------------------------------------------------------

    def evaluate(self, step: int):
        r = self.cfg.rl
        self.phases.enter("generate")
        return pass_at_k_eval(self.engine, self.eval_ds, self.tok, n_prompts=r.eval_prompts, k=r.eval_samples,
                              params=eval_sampling(r, self.tok.stop_ids),
                              seed=mix_seed(self.cfg.train.seed, 99991), reward_fn=self.eval_reward_fn)

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


def _add(pairs: dict, name: str, total, count: int) -> None:
    """Accumulate a (sum, count) metric over the rounds of one step."""
    s, c = pairs.get(name, (0.0, 0))
    pairs[name] = (s + float(total), c + count)


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


def build_stage(cfg: Config, stage_dir: str) -> RLStage:
    return RLStage(cfg, stage_dir)


def main(cfg: Config) -> dict:
    return train_stage(cfg, STAGE, build_stage)
