"""SFT -> reward model -> RL (or SFT -> DPO) in one run directory, from one config file.

    megarl pipeline --config configs/tiny_pipeline.yaml [--stages rm,rl] [key=value ...]
    megarl pipeline --config configs/tiny_dpo_pipeline.yaml --stages sft,dpo

The config's shared sections (model, tokenizer, parallel, tracking, train.run_dir, ...) apply
to every stage; `stages.<sft|dpo|rm|rl>` holds each stage's own values (steps, lr, batch sizes,
data), merged over the shared ones field by field. Overrides: a shared one (`train.steps=5`)
sets that key in every stage, over the stage sections' own values; a stage one
(`stages.rl.optim.lr=1e-6`) sets it in that stage only, and wins over a shared one whatever
their order. Every stage still to run passes `megarl validate`'s checks before the first
stage's first step. A stage whose final checkpoint exists is skipped, unless asked for with
settings that change what it trains (then the run stops and names them); an interrupted one
resumes. Every stage's console output also goes to <run_dir>/logs/<stage>.log,
and the resolved per-stage configs to <run_dir>/logs/pipeline.yaml.

Python, in a notebook or a script (one process, or every rank under torchrun):

    >>> import megarl
    >>> pipe = megarl.Pipeline("configs/tiny_pipeline.yaml", ["train.run_dir=runs/notebook"])
    >>> results = pipe.run()                     # or pipe.sft(); pipe.reward_model(); pipe.rl(); pipe.dpo()
    >>> sorted(results)
    ['rl', 'rm', 'sft']
"""
from __future__ import annotations

import contextlib
import os
import sys

import yaml

from megarl.config import Config, ConfigError
from megarl.config.loader import apply_override, build_config, deep_merge, fit_short_run, from_hf_first, read_yaml
from megarl.config.shipped import resolve_config_path


STAGES = ("sft", "dpo", "rm", "rl")  # pipeline order
DEFAULT_STAGES = ("sft", "rm", "rl")  # what runs unless --stages names others (e.g. sft,dpo)
STAGE_DIRS = {"sft": "sft", "dpo": "dpo", "rm": "reward_model", "rl": "rl"}


def load_pipeline_config(path: str | None, overrides=()) -> dict[str, Config]:
    """{stage: resolved Config} for sft, dpo, rm and rl. A shared override reaches every stage (as
    `train.steps=5` on a single-stage recipe would); stage overrides are applied after them."""
    data = read_yaml(resolve_config_path(path)) if path else {}
    per_stage = data.pop("stages", None) or {}
    where = path or "config"
    if not isinstance(per_stage, dict) or set(per_stage) - set(STAGES):
        bad = sorted(set(per_stage) - set(STAGES)) if isinstance(per_stage, dict) else per_stage
        raise ConfigError(f"{where}: 'stages' holds {', '.join(STAGES)} (one mapping each); got {bad}")
    per_stage = {k: dict(v or {}) for k, v in per_stage.items()}
    staged = [o for o in overrides if o.partition("=")[0].strip().startswith("stages.")]
    for o in (o for o in from_hf_first(overrides) if o not in staged):
        data = apply_override(data, o)
        for stage, section in per_stage.items():
            if _sets(section, o.partition("=")[0].strip().split(".")):
                per_stage[stage] = apply_override(section, o)
    for o in from_hf_first(staged):
        stage, _, rest = o.partition("=")[0].strip()[len("stages."):].partition(".")
        if stage not in STAGES or not rest:
            raise ConfigError(f"override '{o}': expected stages.<{'|'.join(STAGES)}>.section.key=value")
        per_stage[stage] = apply_override(per_stage.setdefault(stage, {}), o.strip()[len(f"stages.{stage}."):])
    configs = {}
    for stage in STAGES:
        configs[stage] = fit_short_run(build_config(deep_merge(data, per_stage.get(stage, {})),
                                                   f"{where} (stage {stage})"), f"stage {stage}: ")
    _check_shared(configs)
    return configs


def _sets(section: dict, parts: list[str]) -> bool:
    """Whether a stage's section gives the dotted key itself (it would shadow a shared value)."""
    for p in parts:
        if not isinstance(section, dict) or p not in section:
            return False
        section = section[p]
    return True


def check_stages(configs: dict[str, Config], world_size: int, stages=STAGES, where: str = "config") -> None:
    """`megarl validate`'s rules for each given stage, before any of them runs; the message names
    the stage: "<config> (stage rm): invalid config: ..."."""
    from megarl.config import validate_config
    from megarl.trainers.data_setup import tool_errors

    for stage in (s for s in STAGES if s in stages):
        try:
            validate_config(configs[stage], world_size, stage="rl" if stage == "rl" else None)
        except ConfigError as e:
            raise ConfigError(f"{where} (stage {stage}): {e}") from None
        errs = tool_errors(configs[stage]) if stage == "rl" else []
        if errs:  # the python tool's sandbox, before the first stage loads a role
            raise ConfigError(f"{where} (stage {stage}): {errs[0]}")


def _check_shared(configs: dict) -> None:
    """What must be the same in every stage: the tokenizer, its vocabulary and the run dir."""
    ref = configs["sft"]
    for stage, cfg in configs.items():
        for what, get in (("tokenizer", lambda c: c.tokenizer), ("model.vocab_size", lambda c: c.model.vocab_size),
                          ("train.run_dir", lambda c: os.path.abspath(c.train.run_dir))):
            if get(cfg) != get(ref):
                raise ConfigError(f"stages.{stage}: {what} ({get(cfg)}) differs from stage sft's ({get(ref)}); "
                                  "every stage must share it (set it in the shared sections)")


# A decoded token costs about as much as 8 tokens of a training forward (one small forward per
# token): the quickstart's GRPO step (~1.35 s) against its SFT step (~0.25 s), quiet CPU.
DECODE_COST = 8


def stage_work(cfg: Config, stage: str) -> tuple[float, float]:
    """(work per step, work of the stage) in forward-token units (a backward counts 2), for the
    run's ETA: a stage not yet started is assumed to go at the running stage's pace per unit.
    RL's rows are prompts x samples, of a prompt (a quarter of its limit: prompts are mostly
    shorter) and max_new_tokens; its evaluations count too (before step 1 and every interval)."""
    t, d, r = cfg.train, cfg.data, cfg.rl
    if stage != "rl":
        # a pair is two sequences; DPO adds the reference's forward
        per_step = d.global_batch_size * d.seq_length * {"rm": 6, "dpo": 8}.get(stage, 3)
        return per_step, per_step * t.steps
    new, rows = r.max_new_tokens, r.prompts_per_step * r.samples_per_prompt
    length = new + r.max_prompt_len // 4
    forwards = 1 + (r.kl_coef > 0) + (r.old_logprobs == "recompute")  # scoring passes before training
    per_step = rows * (DECODE_COST * new + length * (forwards + 3 * r.ppo_epochs))
    evals = (1 + t.steps // t.eval_interval) if t.eval_interval else 0
    return per_step, per_step * t.steps + evals * r.eval_prompts * r.eval_samples * DECODE_COST * new


class RunETA:
    """The pipeline's part of each progress line: `stage i/n, run ETA ~m:ss` for the stages still
    to run (in order), from the running stage's measured pace and the later stages' work."""

    def __init__(self, configs: dict[str, Config]):
        self.stages = list(configs)
        self.work = {s: stage_work(c, s) for s, c in configs.items()}

    def reporter(self, stage: str):
        from megarl.trainers.loop import clock

        i = self.stages.index(stage)
        later = sum(self.work[s][1] for s in self.stages[i + 1:])

        def line(done: int, total: int, seconds_per_step: float) -> str:
            rest = seconds_per_step * (total - done + later / self.work[stage][0])
            return f"pipeline stage {i + 1}/{len(self.stages)}, run ETA ~{clock(rest)}"

        return line


class _Tee:
    """Console output to the terminal and a stage's log file (rank 0)."""

    def __init__(self, stream, path):
        self.stream, self.file = stream, open(path, "a", buffering=1)

    def write(self, text):
        self.stream.write(text)
        if not self.file.closed:  # a logging handler may outlive the stage
            self.file.write(text)
        return len(text)

    def flush(self):
        self.stream.flush()
        if not self.file.closed:
            self.file.flush()

    def isatty(self):
        return self.stream.isatty()


class Pipeline:
    """SFT -> reward model -> RL (or SFT -> DPO) on one run directory (see the module docstring for an example).

    config: a pipeline YAML path, or {stage: Config} from `load_pipeline_config`. Each method
    runs one stage as `megarl <stage>` would and returns its final metrics; a stage that has
    already finished is skipped (its final metrics are read back from its metrics.jsonl).
    """

    def __init__(self, config, overrides=()):
        self.configs = config if isinstance(config, dict) else load_pipeline_config(config, list(overrides))
        self.where = "config" if isinstance(config, dict) else str(config)
        self.run_dir = os.path.abspath(self.configs["sft"].train.run_dir)

    def sft(self) -> dict:
        return self.run(["sft"])["sft"]

    def reward_model(self) -> dict:
        return self.run(["rm"])["rm"]

    def rl(self) -> dict:
        return self.run(["rl"])["rl"]

    def dpo(self) -> dict:
        return self.run(["dpo"])["dpo"]

    def run(self, stages=DEFAULT_STAGES) -> dict:
        """The given stages in pipeline order; {stage: final metrics}."""
        unknown = sorted(set(stages) - set(STAGES))
        if unknown:
            raise ConfigError(f"--stages: unknown stage(s) {', '.join(unknown)}; choose from {', '.join(STAGES)}")
        from megarl.runtime.distributed import is_rank0, world_size_from_env
        from megarl.trainers.data_setup import finished_stage_errors
        from megarl.trainers.run_lock import release

        todo = [s for s in STAGES if s in stages and self._done(s) is None]  # finished ones are skipped
        check_stages(self.configs, world_size_from_env(), todo, self.where)
        changed = [line for s in STAGES if s in stages and s not in todo  # ... unless asked with other settings
                   for line in finished_stage_errors(self.configs[s], STAGE_DIRS[s])]
        if changed:
            raise ConfigError(changed[0] if len(changed) == 1 else "cannot start:\n  " + "\n  ".join(changed))
        eta = RunETA({s: self.configs[s] for s in todo})
        if todo and is_rank0():
            steps = ", ".join(f"{s} {self.configs[s].train.steps} steps" for s in todo)
            print(f"[megarl pipeline] to run: {steps}; run dir {self.run_dir}", flush=True)
        try:  # the first stage's session takes the run dir's lock (trainers/session.py); ours to release
            self._write_resolved()
            return {s: self._stage(s, eta) for s in STAGES if s in stages}
        finally:
            release(self.run_dir)

    # ----------------------------------------------------------------------------------------

    def _write_resolved(self) -> None:
        from megarl.config import config_to_dict
        from megarl.runtime.distributed import is_rank0
        from megarl.utils.atomic import write_atomic

        if is_rank0():
            os.makedirs(os.path.join(self.run_dir, "logs"), exist_ok=True)
            text = yaml.safe_dump({s: config_to_dict(c) for s, c in self.configs.items()}, sort_keys=False)
            write_atomic(os.path.join(self.run_dir, "logs", "pipeline.yaml"), text)

    def _done(self, stage: str) -> dict | None:
        """The final metrics of a finished stage, else None."""
        import json

        from megarl.checkpoint.distributed import latest_checkpoint

        cfg, stage_dir = self.configs[stage], os.path.join(self.run_dir, STAGE_DIRS[stage])
        latest = latest_checkpoint(os.path.join(stage_dir, "checkpoints"))
        if latest is None or int(os.path.basename(latest).split("_")[1]) < cfg.train.steps:
            return None
        final: dict = {}
        path = os.path.join(stage_dir, "metrics.jsonl")
        if os.path.exists(path):
            with open(path) as f:
                for line in f:
                    final.update({k: v for k, v in json.loads(line).items() if k != "step"})
        return final

    def _stage(self, stage: str, eta: RunETA) -> dict:
        from megarl.utils.notices import quiet_megatron_notices

        with quiet_megatron_notices():  # as the CLI: megatron's TE/apex notices are not for users
            return self._run_stage(stage, eta)

    def _run_stage(self, stage: str, eta: RunETA) -> dict:
        from megarl.runtime.distributed import is_rank0, teardown
        from megarl.trainers import dpo, reward_model, rl, sft
        from megarl.trainers.loop import train_stage

        done = self._done(stage)
        if done is not None:
            if is_rank0():
                print(f"[megarl pipeline] {stage}: already complete ({self.configs[stage].train.steps} steps); "
                      f"skipping. Results: {os.path.join(self.run_dir, STAGE_DIRS[stage])}", flush=True)
            return done
        module = {"sft": sft, "dpo": dpo, "rm": reward_model, "rl": rl}[stage]
        cfg = self.configs[stage]
        logs = os.path.join(self.run_dir, "logs")
        tee = contextlib.nullcontext()
        if is_rank0():
            os.makedirs(logs, exist_ok=True)
            tee = _redirect(os.path.join(logs, f"{stage}.log"))
        try:
            with tee:
                return train_stage(cfg, module.STAGE, module.build_stage, keep_process_group=True,
                                   run=eta.reporter(stage))
        except BaseException:
            teardown()
            raise


@contextlib.contextmanager
def _redirect(path: str):
    """stdout and stderr also into `path` (the stage's session binds its log handler to them)."""
    out, err = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _Tee(out, path), _Tee(err, path)
    try:
        yield
    finally:
        for tee in (sys.stdout, sys.stderr):
            tee.file.close()
        sys.stdout, sys.stderr = out, err


def summary(run_dir: str) -> str:
    """The pipeline's held-out figures as a markdown table: the RL stage's first evaluation
    (the SFT model it starts from) and last one, DPO's likewise, and the reward model's last
    pair accuracy."""
    import json

    def evals(stage):
        path = os.path.join(run_dir, stage, "metrics.jsonl")
        if not os.path.exists(path):
            return []
        with open(path) as f:
            return [r for r in map(json.loads, f) if any(k.startswith("eval/") for k in r)]

    rows = []
    rl = evals("rl")
    if rl:
        ks = sorted(k for k in rl[0] if k.startswith(("eval/pass_at_", "eval/mean_at_")))
        for label, rec in (("after SFT (RL step 0)", rl[0]), (f"after RL (step {rl[-1]['step']})", rl[-1])):
            if rec is rl[0] and rec["step"] != 0:
                continue
            rows.append((label, ", ".join(f"{k[5:].replace('_at_', '@')} {rec[k]:.3f}" for k in ks if k in rec)))
    rm = evals("reward_model")
    if rm and "eval/pair_accuracy" in rm[-1]:
        rows.append((f"reward model (step {rm[-1]['step']})", f"held-out pair accuracy {rm[-1]['eval/pair_accuracy']:.3f}"))
    dpo = evals("dpo")
    if dpo and "eval/likelihood_accuracy" in dpo[-1]:
        for label, rec in (("before DPO (the SFT model)", dpo[0]), (f"after DPO (step {dpo[-1]['step']})", dpo[-1])):
            if rec is dpo[0] and rec["step"] != 0:
                continue
            reward = "" if rec is dpo[0] else f", reward accuracy {rec['eval/reward_accuracy']:.3f}"  # 0 at its reference
            rows.append((label, f"held-out likelihood accuracy {rec['eval/likelihood_accuracy']:.3f}{reward}"))
    sft = evals("sft")
    if sft and "eval/sample_accuracy" in sft[-1]:
        rows.append((f"SFT greedy samples (step {sft[-1]['step']})", f"accuracy {sft[-1]['eval/sample_accuracy']:.3f}"))
    lines = ["| model | held-out figures |", "|---|---|"] + [f"| {a} | {b} |" for a, b in rows]
    return "\n".join(lines)


def run_pipeline(path: str, overrides=(), stages=DEFAULT_STAGES) -> dict:
    """`megarl pipeline`: the stages in order, then the figures; the process group is torn down."""
    from megarl.runtime.distributed import is_rank0, teardown

    try:
        pipe = Pipeline(path, overrides)
        results = pipe.run(stages)
        if is_rank0():
            print(f"\nmegarl pipeline: {pipe.run_dir}\n{summary(pipe.run_dir)}", flush=True)
        return results
    finally:
        teardown()
