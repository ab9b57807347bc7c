"""Every command in README.md and docs/*.md is checked, so that a broken one cannot come back
(issue 13, "docs that fail when run").

The commands are the lines of the shell code blocks (```bash, a plain ```, and 4-space indented
blocks): continuation lines joined, a trailing `# comment` dropped (a comment `# or: CMD` names a
second command). COMMANDS says how each one is checked; the test fails for a command the docs hold
that COMMANDS lacks (add it), and for an entry that no doc holds any more. The checks:

  Run       run it in a scratch directory (relative paths such as runs/quickstart land there),
            PLACEHOLDERS replaced, with tiny step counts and model sizes appended as key=value
            overrides: exit 0, and what it must print or write. One tiny SFT -> RM -> GRPO run dir
            (runs/quickstart) serves the commands that need a checkpoint (rl, eval, convert, report).
  Validate  `megarl validate` of the exact config, overrides, world size and stage, where running
            costs too much here (several ranks, an 8B model, a SLURM job, the full quickstart).
  Help      the program's --help lists every option the command uses (benchmarks, GPU-only ones).
  Script    the script exists, is executable and parses (`bash -n`).
  Files     paths the command reads exist (after the runs it depends on).
Blocks that hold no command (the launchers' grammar, a diagram, a directory tree) are listed in
NOT_COMMANDS by their first line; Python snippets in PYTHON_SNIPPETS.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = ["README.md", *(f"docs/{p.name}" for p in sorted((REPO / "docs").glob("*.md")))]
SHELL_LANGS = {"", "bash", "sh", "shell", "console"}
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")

# --------------------------------------------------------------------------- reading the docs


def code_blocks(text: str):
    """(language, line number of the first line, lines) of each fenced or indented code block;
    indented blocks have the language "indented"."""
    lines, i = text.splitlines(), 0
    while i < len(lines):
        fence = re.match(r"^```(\S*)\s*$", lines[i])
        if fence:
            end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), len(lines))
            yield fence[1], i + 2, lines[i + 1:end]
            i = end + 1
        elif lines[i].startswith("    ") and lines[i].strip() and (i == 0 or not lines[i - 1].strip()):
            end = next((j for j in range(i, len(lines)) if not lines[j].startswith("    ")), len(lines))
            yield "indented", i + 1, lines[i:end]
            i = end
        else:
            i += 1


def block_commands(lines, first: int):
    """(line number, command) of each command line: continuations joined, comments dropped,
    whitespace collapsed; `CMD  # or: OTHER` gives both."""
    out, buf, start = [], "", None
    for n, raw in enumerate(lines, first):
        start = n if start is None else start
        buf = f"{buf} {raw.strip()}" if buf else raw.strip()
        if buf.endswith("\\"):
            buf = buf[:-1].rstrip()
            continue
        m = re.search(r"(^|\s)#(.*)$", buf)
        command, comment = (buf[:m.start()], m[2].strip()) if m else (buf, "")
        for cmd in (command, comment[3:] if comment.startswith("or:") else ""):
            if cmd.strip():
                out.append((start, " ".join(cmd.split())))
        buf, start = "", None
    return out


def doc_commands():
    """{command: [where, ...]} over README.md and docs/*.md."""
    found: dict[str, list[str]] = {}
    for doc in DOCS:
        for lang, first, lines in code_blocks((REPO / doc).read_text()):
            if lang not in SHELL_LANGS and lang != "indented":
                continue
            cmds = block_commands(lines, first)
            if not cmds or cmds[0][1] in NOT_COMMANDS:
                continue
            for n, cmd in cmds:
                found.setdefault(cmd, []).append(f"{doc}:{n}")
    return found


def python_snippets():
    """{first line: (where, code)} of the ```python blocks."""
    out = {}
    for doc in DOCS:
        for lang, first, lines in code_blocks((REPO / doc).read_text()):
            if lang == "python" and lines:
                out[lines[0].strip()] = (f"{doc}:{first}", "\n".join(lines))
    return out


# --------------------------------------------------------------------------- running them

# Placeholders in the docs -> what stands for them in the scratch directory.
PLACEHOLDERS = {
    "runs/x": "runs/quickstart",  # "some run dir": the shared tiny run
    "runs/mine": "runs/quickstart",  # the README's "Using it" run dir: the shared tiny run
    "R": "runs/quickstart",  # docs/benchmarks.md: the run dir of the commands above
    "R2": "runs/r2",
    "N": "300", "S": "30", "E": "10",  # step counts and intervals (values the docs used)
    "M": "0.3", "LR": "6e-5",  # docs/benchmarks.md: sft_mistakes and an RL lr of its tables
    "/models/Qwen2-0.5B": "models/Qwen2-0.5B",  # a tiny Qwen2 saved with transformers (_hf_qwen2)
}
STEP_DIRS = {"step_0000XXXX": "step_00000002", "step_00000400": "step_00000002"}  # the shared SFT's checkpoint

TINY_MODEL = ["model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128"]
TINY = [*TINY_MODEL, "lr_schedule.warmup_steps=0", "train.eval_interval=0", "data.global_batch_size=8",
        "data.micro_batch_size=8"]
TINY_RL = [*TINY, "train.steps=1", "rl.prompts_per_step=4", "rl.samples_per_prompt=2", "rl.max_new_tokens=8",
           "rl.eval_prompts=4", "rl.eval_samples=2"]
TINY_RL_STEPS = [o for o in TINY_RL if not o.startswith("model.")]  # for a model.from_hf run: its model as it is
TINY_EVAL = [*TINY_MODEL, "rl.eval_prompts=4", "rl.eval_samples=2", "rl.max_new_tokens=8", "tracking.backend=none"]


def _placeholder(value: str) -> str:
    for key, new in PLACEHOLDERS.items():
        if value == key or value.startswith(key + "/"):
            value = new + value[len(key):]
            break
    return "/".join(STEP_DIRS.get(p, p) for p in value.split("/"))


def concrete(cmd: str) -> list[str]:
    """The documented command as run here: an optional `[--flag x]` / `[key=value]` kept, an
    optional `[prose]` dropped, placeholders replaced (in paths and in key=value values)."""
    cmd = re.sub(r"\[([^\]]*)\]", lambda m: m[1] if re.match(r"--|[\w.]+=", m[1]) else "", cmd)
    out = []
    for tok in shlex.split(cmd):
        if "=" in tok and not tok.startswith("-"):
            key, _, value = tok.partition("=")
            out.append(f"{key}={_placeholder(value)}")
        else:
            out.append(_placeholder(tok))
    return out


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               # this tree's megarl, whichever checkout the `megarl` console script was installed from
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "MLFLOW_TRACKING_URI",
              "MEGARL_TORCHRUN_ARGS", "MEGARL_BIN"):
        env.pop(k, None)
    return env


def execute(argv: list[str], work: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    env = _env()
    while argv and ENV_ASSIGNMENT.match(argv[0]):
        key, _, value = argv.pop(0).partition("=")
        env[key] = value
    if argv[0] in ("python", "python3"):
        argv = [sys.executable, *argv[1:]]
    return subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=timeout)


def stage_command(argv: list[str]):
    """(world size or None, stage, config, overrides) of `megarl STAGE --config C ...`,
    `launchers/local/run.sh N STAGE C ...` or `sbatch ... megarl.sbatch STAGE C ...`."""
    argv = list(argv)
    while ENV_ASSIGNMENT.match(argv[0]):
        argv.pop(0)
    world, config = None, None
    if argv[0] == "megarl":
        stage, rest = argv[1], argv[2:]
        if "--config" in rest:
            i = rest.index("--config")
            config, rest = rest[i + 1], rest[:i] + rest[i + 2:]
    elif argv[0].endswith("launchers/local/run.sh"):
        world = 1 if argv[1] == "auto" else int(argv[1])  # auto: one rank per GPU, 1 on CPU
        stage, config, rest = argv[2], argv[3], argv[4:]
    elif argv[0] == "sbatch":
        i = next(i for i, a in enumerate(argv) if a.endswith("megarl.sbatch"))
        stage, config, rest = argv[i + 1], argv[i + 2], argv[i + 3:]
    else:
        raise AssertionError(f"not a stage command: {argv}")
    overrides, skip = [], False
    for a in rest:  # drop the stage's own options (--checkpoint DIR, --stages rm,rl)
        if skip:
            skip = False
        elif a.startswith("-"):
            skip = "=" not in a
        else:
            overrides.append(a)
    return world, stage, config, overrides


_RUNS: dict[str, object] = {}  # Run name -> None (passed) or the failure message
_RAN: dict[tuple, subprocess.CompletedProcess] = {}  # each distinct command line runs once


def ensure(name: str, work: Path) -> None:
    """Run the Run check called `name` once per session (with what it needs first)."""
    if name not in _RUNS:
        cmd, run = next((c, chk) for c, checks in COMMANDS.items() for chk in checks
                        if isinstance(chk, Run) and chk.name == name)
        try:
            run.execute(cmd, work)
            _RUNS[name] = None
        except AssertionError as e:
            _RUNS[name] = str(e)
    if _RUNS[name] is not None:
        raise AssertionError(f"{name} failed: {_RUNS[name]}")


@dataclass
class Run:
    name: str = ""
    extra: tuple = ()  # key=value overrides appended (tiny sizes); later ones win
    needs: tuple = ()  # names of Runs whose output this one reads
    before: object = None  # callable(work): fixtures this command needs
    prints: str = ""  # a line fragment the output must contain
    writes: tuple = ()  # paths (relative to the scratch dir) it must create

    def __call__(self, cmd, work, **_):
        if self.name:
            ensure(self.name, work)
        else:
            self.execute(cmd, work)

    def execute(self, cmd, work):
        argv = concrete(cmd) + list(self.extra)
        if tuple(argv) in _RAN:  # e.g. `megarl report runs/x` is `megarl report runs/quickstart` here
            out = _RAN[tuple(argv)]
        else:
            for need in self.needs:
                ensure(need, work)
            if self.before:
                self.before(work)
            out = _RAN[tuple(argv)] = execute(argv, work)
        log = f"$ {shlex.join(argv)}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
        assert out.returncode == 0, f"exit {out.returncode}:\n{log}"
        assert "Traceback" not in out.stderr, log
        assert self.prints in out.stdout + out.stderr, f"expected {self.prints!r} in the output:\n{log}"
        for path in self.writes:
            assert (work / path).exists(), f"{path} not written:\n{log}"


@dataclass
class Validate:
    world: int | None = None  # default: run.sh's NPROC, else 1
    needs: tuple = ()
    command: str = ""  # validate this stage command instead (what a script runs)
    absent_inputs: bool = False  # the only errors allowed: input files this machine lacks

    def __call__(self, cmd, work, capsys, monkeypatch, **_):
        from megarl.cli.main import main

        for need in self.needs:
            ensure(need, work)
        argv = concrete(self.command or cmd)
        if argv[:2] == ["megarl", "validate"]:  # the command is itself a validate: as it is
            args = argv[1:]
        else:
            world, stage, config, overrides = stage_command(argv)
            # a command that reads the shared run dir's checkpoints is checked with the model they
            # were saved with (the tests' tiny one): pre-flight compares the two
            args = ["validate", "--config", config, "--world-size", str(self.world or world or 1), "--stage", stage,
                    *overrides, *(TINY_MODEL if self.needs else ())]
        monkeypatch.chdir(work)
        capsys.readouterr()
        rc = main(args)
        err = capsys.readouterr().err
        if rc != 0 and self.absent_inputs:
            lines = [ln.strip() for ln in err.replace("megarl: error: cannot start:", "").splitlines() if ln.strip()]
            missing = [re.match(r"(megarl: error: )?[\w.]+: (/\S+) does not exist( \(.*\))?$", ln) for ln in lines]
            if lines and all(m and not os.path.exists(m[2]) for m in missing):
                return
        assert rc == 0, f"megarl {shlex.join(args)}: exit {rc}\n{err}"


_HELP: dict[tuple, str] = {}


@dataclass
class Help:
    def __call__(self, cmd, work, **_):
        argv = concrete(cmd)
        while ENV_ASSIGNMENT.match(argv[0]):
            argv.pop(0)
        program = tuple(argv[:next(i for i, a in enumerate(argv) if a.startswith("-"))])
        if program not in _HELP:
            out = execute([*program, "--help"], work, timeout=120)
            assert out.returncode == 0, f"{' '.join(program)} --help: exit {out.returncode}\n{out.stderr[-2000:]}"
            _HELP[program] = out.stdout
        flags = [a.split("=")[0] for a in argv if a.startswith("--")]
        assert [f for f in flags if f not in _HELP[program]] == [], f"{' '.join(program)} --help lacks options"


@dataclass
class Script:
    runs: str = ""  # text the script must hold (the command a Validate beside this one checks)

    def __call__(self, cmd, work, **_):
        argv = [a for a in concrete(cmd) if not ENV_ASSIGNMENT.match(a)]
        path = REPO / next(a for a in argv if a.endswith((".sh", ".sbatch")))
        assert path.is_file(), f"{path} does not exist"
        assert path.suffix == ".sbatch" or os.access(path, os.X_OK), f"{path} is not executable"  # sbatch reads it
        out = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        assert self.runs in path.read_text(), f"{path} no longer runs {self.runs!r}"


@dataclass
class Files:
    paths: tuple
    needs: tuple = ()

    def __call__(self, cmd, work, **_):
        for need in self.needs:
            ensure(need, work)
        assert [p for p in self.paths if not (work / p).exists()] == []


def _hf_qwen2(work: Path) -> None:
    """The README's /models/Qwen2-0.5B: a tiny random Qwen2 and its own tokenizer (hf_fixtures.py)."""
    pytest.importorskip("transformers")
    from hf_fixtures import save_qwen2

    if not (work / "models" / "Qwen2-0.5B" / "config.json").exists():
        save_qwen2(work / "models" / "Qwen2-0.5B")


def _copy_run(src: str, dst: str, parts=("data", "sft", "reward_model")):
    def copy(work: Path):
        for part in parts:
            shutil.copytree(work / src / part, work / dst / part, dirs_exist_ok=True)
    return copy


# --------------------------------------------------------------------------- the table

NOT_COMMANDS = {
    "STAGE CONFIG [key=value ...]": "docs/launching.md: the launchers' argument grammar",
    "sbatch megarl.sbatch -> job.sh (batch node) -> srun, 1 task per node -> node.sh -> launchers/torchrun.py -> ranks":
        "docs/launching.md: a diagram of the processes",
    "<train.run_dir>/": "docs/ARCHITECTURE.md: the run directory's tree",
}

PYTHON_SNIPPETS = {  # first line -> run (with Pipeline.run stubbed) or compile and name-check only
    "import megarl": "run",
    "from megarl.tracking import create_tracker": "compile",
}

COMMANDS = {
    # ---- README.md: quick start (the full quickstart, which also installs, and the suite are too
    # long to run here)
    "launchers/local/quickstart.sh": (Script(runs="pipeline --config configs/tiny_pipeline.yaml"),
                                      Validate(command="megarl pipeline --config configs/tiny_pipeline.yaml")),
    "tests/run.sh": (Script(),),
    # ---- README.md: using it (one shared tiny run dir: runs/quickstart)
    "megarl sft --config configs/tiny_sft.yaml train.run_dir=runs/mine optim.lr=1e-3 train.steps=100":
        (Run("sft", extra=(*TINY, "train.steps=2"), writes=("runs/quickstart/sft/checkpoints/latest",)),),
    "launchers/local/run.sh 4 sft configs/tiny_sft.yaml train.run_dir=runs/tp2pp2 parallel.tp=2 parallel.pp=2":
        (Validate(), Script()),
    "megarl rm --config configs/tiny_rm.yaml train.run_dir=runs/mine":
        (Run("rm", needs=("sft",), extra=(*TINY, "train.steps=1"),
             writes=("runs/quickstart/reward_model/checkpoints/latest",)),),
    "megarl rl --config configs/tiny_grpo.yaml train.run_dir=runs/mine":
        (Run("grpo", needs=("sft",), extra=TINY_RL, writes=("runs/quickstart/rl/checkpoints/latest",)),),
    "megarl rl --config configs/tiny_ppo.yaml train.run_dir=runs/ppo":  # its sft/ and reward_model/: the shared run's
        (Run("ppo", needs=("rm",), before=_copy_run("runs/quickstart", "runs/ppo"),
             extra=(*TINY_RL, "train.run_dir=runs/ppo", "tracking.backend=none"),
             writes=("runs/ppo/rl/checkpoints/latest",)),),
    "megarl rl --config configs/tiny_dapo.yaml train.run_dir=runs/dapo":  # its sft/: the shared run's
        (Run("dapo", needs=("sft",), before=_copy_run("runs/quickstart", "runs/dapo", ("data", "sft")),
             extra=(*TINY_RL, "train.run_dir=runs/dapo", "tracking.backend=none"),
             writes=("runs/dapo/rl/checkpoints/latest",)),),
    "megarl dpo --config configs/tiny_dpo.yaml train.run_dir=runs/dpo":  # its sft/: the shared run's
        (Run("dpo", needs=("sft",), before=_copy_run("runs/quickstart", "runs/dpo", ("data", "sft")),
             extra=(*TINY, "train.steps=1", "train.run_dir=runs/dpo", "tracking.backend=none"),
             writes=("runs/dpo/dpo/checkpoints/latest",)),),
    # in a copy holding the shared run's SFT: the shared run's rm/ and rl/ were trained with other
    # settings than the pipeline's, which it refuses (test_pipeline.py: finished stages skipped)
    "megarl pipeline --config configs/tiny_pipeline.yaml [--stages rm,rl]":
        (Run(needs=("sft",), before=_copy_run("runs/quickstart", "runs/pipeline", ("data", "sft")),
             extra=(*TINY_RL, "train.run_dir=runs/pipeline", "tracking.backend=none"),
             prints="to run: rm 1 steps, rl 1 steps", writes=("runs/pipeline/rl/checkpoints/latest",)), Validate()),
    "megarl eval --config configs/tiny_grpo.yaml --checkpoint rl train.run_dir=runs/mine":
        (Run(needs=("grpo",), extra=TINY_EVAL, writes=("runs/quickstart/eval/results.json",)),),
    "megarl validate --config configs/llama31_8b_grpo.yaml --world-size 8 --stage rl":
        (Validate(absent_inputs=True),),  # /models/Llama-3.1-8B-Instruct, /data/gsm8k: not on a CI box
    "megarl convert hf-to-megarl --hf /models/Qwen2-0.5B --out ckpt/qwen2":
        (Run(before=_hf_qwen2, writes=("ckpt/qwen2/latest", "ckpt/qwen2/config.yaml")),),
    "megarl convert megarl-to-hf --checkpoint runs/x/sft/checkpoints --out hf/ --arch llama":
        (Run(needs=("sft",), writes=("hf/config.json",)),),
    # ---- README.md: your own Hugging Face model (tests/test_hf_model.py runs it with more checks)
    "megarl rl --config configs/tiny_grpo.yaml train.run_dir=runs/qwen2_grpo model.from_hf=/models/Qwen2-0.5B "
    "roles.actor.init_from=/models/Qwen2-0.5B tokenizer.kind=hf tokenizer.path=/models/Qwen2-0.5B":
        (Run("hf_rl", before=_hf_qwen2, extra=(*TINY_RL_STEPS, "tracking.backend=none"),
             prints="actor initialised from models/Qwen2-0.5B", writes=("runs/qwen2_grpo/rl/checkpoints/latest",)),),
    "megarl convert megarl-to-hf --checkpoint runs/qwen2_grpo/rl/checkpoints --out runs/qwen2_grpo/hf --arch qwen2":
        (Run(needs=("hf_rl",), writes=("runs/qwen2_grpo/hf/tokenizer.json",)),),
    "megarl report runs/mine":
        (Run(needs=("sft", "rm", "grpo"), writes=("runs/quickstart/report/report.md",)),),
    "sbatch -N 4 launchers/slurm/megarl.sbatch rl configs/my_grpo.yaml": (Script(), Validate(needs=("sft",))),
    # ---- README.md: on a GPU cluster (the GPU half runs only where a GPU is: its options here)
    "pip install --no-build-isolation -e .[gpu]": (Help(),),
    "megarl doctor": (Run(prints="GPU checks:"),),  # the CPU half; GPU rows SKIPPED with the reason
    "megarl doctor --gpu --json doctor.json": (Help(),),
    "sbatch -N 2 launchers/slurm/doctor.sbatch": (Script(runs="doctor --allreduce"),),
    "megarl validate --config configs/llama31_8b_grpo_fp8.yaml --world-size 8 --stage rl --gpu-target h100":
        (Validate(absent_inputs=True),),  # /models, /data: not on a CI box
    "sbatch launchers/slurm/megarl.sbatch rl configs/llama31_8b_grpo_fp8.yaml":
        (Script(), Validate(absent_inputs=True, command="megarl validate --config configs/llama31_8b_grpo_fp8.yaml "
                                                        "--world-size 8 --stage rl --gpu-target h100")),
    # ---- docs/launching.md
    # run.sh itself runs below (2 ranks) and in test_failure_paths.py (its check); a 2-rank SFT
    # would add a minute on a 2-core machine
    "launchers/local/run.sh 2 sft configs/tiny_sft.yaml train.run_dir=runs/sft optim.lr=1e-3": (Validate(), Script()),
    "launchers/local/run.sh auto sft configs/tiny_sft.yaml": (Validate(), Script()),
    "MEGARL_DEVICE=cpu launchers/local/run.sh 4 rm configs/tiny_rm.yaml data.micro_batch_size=8":
        (Validate(needs=("sft",)), Script()),
    "launchers/local/run.sh 2 -- python my_check.py": (Run(prints="rank 1 of 2"),),
    "mkdir -p logs": (Run(writes=("logs",)),),
    "sbatch launchers/slurm/megarl.sbatch sft configs/my_sft.yaml optim.lr=1e-5": (Script(), Validate()),
    "sbatch -N 4 --gpus-per-node=8 launchers/slurm/megarl.sbatch rm configs/my_rm.yaml":
        (Script(), Validate(needs=("sft",))),
    "sbatch -N 2 launchers/slurm/megarl.sbatch -- python my_check.py": (Script(),),
    "mlflow ui --backend-store-uri sqlite:///runs/x/mlflow.db":
        (Help(), Files(("runs/quickstart/mlflow.db",), needs=("sft",))),
    "megarl report runs/x": (Run(needs=("sft",), writes=("runs/quickstart/report/report.md",)),),
    "python -m megarl.tracking report runs/x": (Run(needs=("sft",), writes=("runs/quickstart/report/report.md",)),),
    # ---- docs/benchmarks.md (each bench's --help; the stage commands at validate level)
    "python bench/bench_logprobs.py --reps 3": (Help(),),
    "python bench/bench_logprobs.py --reps 3 --threads 1": (Help(),),
    "megarl sft --config configs/tiny_sft.yaml train.run_dir=R [train.steps=N]": (Validate(),),
    "megarl rm --config configs/tiny_rm.yaml train.run_dir=R [overrides below]": (Validate(needs=("sft",)),),
    "python bench/bench_gpu_ops.py --hbm-tbps 3.35": (Help(),),  # needs CUDA
    "python bench/bench_gpu_ops.py --decode --shape 1b --rows 8,64,256 --new-tokens 256": (Help(),),  # needs CUDA
    "launchers/gpu/first_check.sh": (Script(runs="pytest -q -m gpu"),),  # needs CUDA: its syntax and steps here
    "python bench/bench_step.py --gpu": (Help(),),
    "python bench/bench_mismatch.py --steps 3 --init-std 0.1": (Help(),),
    "megarl pipeline --config configs/tiny_pipeline.yaml --stages sft train.run_dir=R data.synthetic.sft_mistakes=M":
        (Validate(),),
    "megarl pipeline --config configs/tiny_pipeline.yaml --stages rl train.run_dir=R data.synthetic.sft_mistakes=M "
    "[stages.rl.optim.lr=LR stages.rl.train.steps=S]": (Validate(),),
    "megarl pipeline --config configs/tiny_pipeline.yaml --stages sft,rl train.run_dir=R train.seed=4321": (Validate(),),
    # ---- docs/benchmarks.md: DAPO vs GRPO, tools with and without the calculator
    "megarl sft --config configs/tiny_sft.yaml train.run_dir=R tracking.backend=none": (Validate(),),
    "megarl rl --config configs/tiny_grpo.yaml train.run_dir=R train.seed=S data.seed=1234 rl.eval_prompts=200 "
    "train.eval_interval=20": (Validate(needs=("sft",)),),
    "megarl rl --config configs/tiny_dapo.yaml train.run_dir=R train.seed=S data.seed=1234 rl.eval_prompts=200 "
    "train.eval_interval=20": (Validate(needs=("sft",)),),
    # ---- docs/benchmarks.md: DPO
    "python bench/bench_dpo.py --out runs/bench_dpo --seeds 1234 2 3": (Help(),),
    "python bench/trl_dpo_check.py --trl-python bench/.venv-trl/bin/python": (Help(),),
    # ---- docs/benchmarks.md: MoE GRPO
    "python bench/bench_moe.py --run-dir runs/bench_moe --steps 60 --eval-interval 30": (Help(),),
    "megarl sft --config configs/tiny_sft_tools.yaml train.run_dir=R data.synthetic.calculator=1.0": (Validate(),),
    "megarl rl --config configs/tiny_grpo_tools.yaml train.run_dir=R data.synthetic.calculator=1.0 train.seed=S "
    "data.seed=1234 train.steps=40 train.eval_interval=20 rl.eval_prompts=100": (Validate(needs=("sft",)),),
}


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """The scratch directory the commands run in: the repository's launchers/, bench/, tests/ and
    configs/ (plus configs/my_*.yaml, the docs' "your recipe") and my_check.py."""
    w = tmp_path_factory.mktemp("docs")
    for d in ("launchers", "bench", "tests"):
        (w / d).symlink_to(REPO / d)
    (w / "configs").mkdir()
    for f in (REPO / "configs").iterdir():
        (w / "configs" / f.name).symlink_to(f.resolve())
    for name, base, own in (("my_grpo", "tiny_grpo", ""), ("my_rm", "tiny_rm", ""),
                            ("my_sft", "tiny_sft", "optim: {min_lr: 1.0e-6}\n")):  # the docs' lr=1e-5 is below tiny_sft's min_lr
        (w / "configs" / f"{name}.yaml").write_text(f"extends: {base}.yaml\n{own}")
    # one write per rank: print(a, b, ...) writes each piece on its own, and the two ranks' pieces
    # interleaved on the shared unbuffered stdout ("rankrank  01  ofof  22")
    (w / "my_check.py").write_text("import os\nprint(f\"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']}\")\n")
    _RUNS.clear()
    _RAN.clear()
    return w


# --------------------------------------------------------------------------- tests


def test_every_documented_command_has_a_check():
    found = doc_commands()
    missing = [f"{where[0]}: {cmd}" for cmd, where in found.items() if cmd not in COMMANDS]
    assert missing == [], "documented commands without a check: add them to COMMANDS in tests/test_docs_commands.py"
    stale = [cmd for cmd in COMMANDS if cmd not in found]
    assert stale == [], "COMMANDS entries no doc holds any more (the docs changed): update or remove them"
    blocks = {cmds[0][1] for doc in DOCS for lang, first, lines in code_blocks((REPO / doc).read_text())
              if (cmds := block_commands(lines, first))}
    assert [k for k in NOT_COMMANDS if k not in blocks] == []
    assert sorted(python_snippets()) == sorted(PYTHON_SNIPPETS)


@pytest.mark.slow
@pytest.mark.parametrize("cmd", list(COMMANDS), ids=lambda c: c if len(c) < 70 else c[:67] + "...")
def test_documented_command(cmd, work, capsys, monkeypatch):
    for check in COMMANDS[cmd]:
        check(cmd, work, capsys=capsys, monkeypatch=monkeypatch)


def test_python_snippets(work, monkeypatch):
    """Each ```python block compiles and names what megarl has; the README's runs (no training)."""
    import importlib

    import megarl

    monkeypatch.chdir(work)
    monkeypatch.setattr(megarl.Pipeline, "run", lambda self, stages=None: {})
    for first, (where, code) in python_snippets().items():
        compile(code, where, "exec")
        for module, name in re.findall(r"from (megarl[\w.]*) import (\w+)", code):
            assert hasattr(importlib.import_module(module), name), (where, module, name)
        for name in re.findall(r"\bmegarl\.(\w+)", code):
            assert hasattr(megarl, name), (where, name)
        if PYTHON_SNIPPETS.get(first) == "run":
            exec(compile(code, where, "exec"), {})
