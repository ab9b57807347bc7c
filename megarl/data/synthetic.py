"""A seeded arithmetic word-problem task, small enough for a tiny model to learn on CPU in minutes.

    Q: "Tom has 3 apples. He buys 4 more. He gives away 2. How many apples now?"
    A: "3+4=7\\n7-2=5\\n#### 5"

Solutions end with `#### n` like GSM8K, so answers.extract_answer / is_correct score both.
Its one schema is `megarl.config.SyntheticConfig` (`data.synthetic`): split sizes, number of
operations, operand range, which operations, largest multiplier, kind of rejected answer.
At the defaults a 2-layer, hidden-64 GPT on the byte tokenizer (seq 128, batch 32, one CPU thread)
reached ~70% greedy test accuracy after 2 minutes of SFT (~20% with max_operand=20).
Preference pairs contrast the worked solution with a plausible wrong one (`SyntheticConfig.rejects`):
  "operand": a quantity misread from the question (arithmetic right, answer wrong); the default;
  "slip":    one step's result is off by 1-2 and later steps carry it forward.
Either way the error reaches the final answer and the solution keeps its shape. Slips are the
harder pairs for a reward model, which has to redo the arithmetic: the quickstart's 4-layer,
hidden-128 RM learns them more slowly than operand pairs (docs/benchmarks.md, "Reward model").
`sft_mistakes` puts the same kind of mistake into that share of the train split's SFT
demonstrations (a noisy teacher, as real SFT data has one): the SFT model then samples such
mistakes at temperature 1, and RL with the rule reward or the RM has room to remove them (the
tiny recipes use 0.3).
`calculator` makes that share of the SFT demonstrations (both splits; only the correct ones) write
each product as a calculator call, GSM8K's `<<23*47=1081>>` (megarl/rollout/tools.py: the model
writes `<<23*47=`, the tool answers `1081>>`, an observation the SFT loss leaves out). With a large
`max_factor` (e.g. 99) products are beyond what a tiny model computes; the calculator is not, so
RL with the calculator in its rollouts can learn when to call it. At 0 (the default) every file is
byte-identical to a task without the option.
"""
import json
import os
import random
from dataclasses import asdict, dataclass

from megarl.config.schema import SyntheticConfig

from megarl.data.errors import DataError
from megarl.utils.atomic import atomic_directory

NAMES = (("Tom", "He"), ("Ann", "She"), ("Bob", "He"), ("Eva", "She"), ("Sam", "He"), ("Mia", "She"),
         ("Leo", "He"), ("Zoe", "She"), ("Max", "He"), ("Ivy", "She"))
ITEMS = ("apples", "pens", "cards", "coins", "books", "eggs", "shells", "stamps", "cups", "balls")
PHRASES = {
    "+": ("buys {n} more", "finds {n} more", "gets {n} more"),
    "-": ("gives away {n}", "loses {n}", "sells {n}"),
    "*": ("now has {n} times as many",),
}
REJECTS = ("operand", "slip")
FILES = ("train_sft.jsonl", "test_sft.jsonl", "train_prefs.jsonl", "test_prefs.jsonl",
         "train_prompts.jsonl", "test_prompts.jsonl")


def check_task(task: SyntheticConfig) -> SyntheticConfig:
    """`task` itself when its knobs make a task; DataError naming the knob otherwise."""
    if task.n_train < 1 or task.n_test < 1:
        raise DataError(f"synthetic task needs n_train >= 1 and n_test >= 1, got {task.n_train}, {task.n_test}")
    if not 1 <= task.min_ops <= task.max_ops:
        raise DataError(f"synthetic task needs 1 <= min_ops <= max_ops, got {task.min_ops}, {task.max_ops}")
    if task.max_operand < 1 or task.max_factor < 2:
        raise DataError("synthetic task needs max_operand >= 1 and max_factor >= 2")
    if not task.ops or set(task.ops) - set(PHRASES):
        raise DataError(f"synthetic task ops must be a non-empty subset of '+-*', got {task.ops!r}")
    if not 0.0 <= task.sft_mistakes < 1.0:
        raise DataError(f"synthetic task needs 0 <= sft_mistakes < 1, got {task.sft_mistakes}")
    if not 0.0 <= task.calculator <= 1.0:
        raise DataError(f"synthetic task needs 0 <= calculator <= 1, got {task.calculator}")
    if task.rejects not in REJECTS:
        raise DataError(f"synthetic task rejects must be one of {', '.join(REJECTS)}, got {task.rejects!r}")
    return task


def difficulty(task: SyntheticConfig) -> dict:
    """The knobs that shape the problems (every field but the split sizes), as meta.json holds them;
    calculator only when it is on (tasks written before it existed keep their meta.json)."""
    return {k: v for k, v in asdict(task).items() if k not in ("n_train", "n_test")
            and not (k == "calculator" and v == 0)}


@dataclass(frozen=True)
class Problem:
    question: str
    steps: tuple[tuple[int, str, int, int], ...]   # (left, op, right, result) per operation
    answer: int

    @property
    def solution(self) -> str:
        return format_solution(self.steps)


def format_solution(steps, calculator: bool = False) -> str:
    """One line per step, `#### answer` last; calculator=True writes products as calculator calls."""
    return "\n".join(f"<<{a}{op}{b}={c}>>" if calculator and op == "*" else f"{a}{op}{b}={c}"
                     for a, op, b, c in steps) + f"\n#### {steps[-1][3]}"


def _apply(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


def make_problem(rng: random.Random, d: SyntheticConfig) -> Problem:
    name, pronoun = rng.choice(NAMES)
    item = rng.choice(ITEMS)
    value = rng.randint(1, d.max_operand)
    sentences = [f"{name} has {value} {item}."]
    steps = []
    for _ in range(rng.randint(d.min_ops, d.max_ops)):
        ops = [op for op in d.ops if op != "-" or value >= 1]  # never go below zero
        op = rng.choice(ops or ["+"])
        if op == "*":
            n = rng.randint(2, d.max_factor)
        elif op == "-":
            n = rng.randint(1, min(value, d.max_operand))
        else:
            n = rng.randint(1, d.max_operand)
        result = _apply(value, op, n)
        sentences.append(f"{pronoun} {rng.choice(PHRASES[op]).format(n=n)}.")
        steps.append((value, op, n, result))
        value = result
    sentences.append(f"How many {item} now?")
    return Problem(" ".join(sentences), tuple(steps), value)


def wrong_solution(problem: Problem, rng: random.Random, d: SyntheticConfig | None = None) -> str:
    """The worked solution with one plausible mistake (d.rejects), carried through later steps."""
    d = d or SyntheticConfig()
    k = rng.randrange(len(problem.steps))
    a, op, b, c = problem.steps[k]
    if d.rejects == "operand":  # the operand misread by 1-2, within the task's own ranges
        lo, hi = (2, d.max_factor) if op == "*" else (1, a if op == "-" else d.max_operand)
        misread = [b + e for e in (-2, -1, 1, 2) if lo <= b + e <= hi]
        if misread and not (op == "*" and a == 0):
            b = rng.choice(misread)
            c = _apply(a, op, b)
        else:  # "2-1", "0*3": no other quantity changes the result, so this step slips instead
            c += rng.choice([e for e in (-2, -1, 1, 2) if c + e >= 0])
    else:
        c += rng.choice([e for e in (-2, -1, 1, 2) if c + e >= 0])
    steps = list(problem.steps[:k]) + [(a, op, b, c)]
    value = c
    for _, op, b, _ in problem.steps[k + 1:]:
        steps.append((value, op, b, _apply(value, op, b)))
        value = steps[-1][3]
    # Off by 1-2 never cancels under +, - and * by >= 2; a misread operand changes the result too.
    assert value != problem.answer
    return format_solution(steps)


def generate_problems(n: int, seed: int, task: SyntheticConfig | None = None) -> list[Problem]:
    """n problems with distinct questions, deterministic in (n, seed, the task's knobs)."""
    task = check_task(task or SyntheticConfig())
    rng = random.Random(seed)
    seen, out, misses = set(), [], 0
    while misses < 2000:  # 2000 duplicates in a row: the difficulty's problem space is exhausted
        if len(out) == n:
            return out
        p = make_problem(rng, task)
        misses = misses + 1 if p.question in seen else 0
        if p.question not in seen:
            seen.add(p.question)
            out.append(p)
    raise DataError(f"synthetic task: only {len(out)} distinct problems found of the {n} asked for; "
                    f"raise max_operand or max_ops")


def records(problems: list[Problem], seed: int, d: SyntheticConfig | None = None,
            mistakes: float = 0.0) -> dict[str, list[dict]]:
    """The three views of a split: SFT conversations, preference pairs, RL prompts with answers.

    `mistakes`: the share of SFT demonstrations that get one mistake of the `d.rejects` kind, drawn
    from a generator of their own so that the pairs do not depend on it.
    """
    d = d or SyntheticConfig()
    rng, noisy = random.Random(seed), random.Random(seed + 7919)
    demos = [wrong_solution(p, noisy, d) if noisy.random() < mistakes else p.solution for p in problems]
    if d.calculator > 0:  # a generator of its own: the other draws do not depend on it
        tools = random.Random(seed + 104729)
        demos = [format_solution(p.steps, calculator=True) if tools.random() < d.calculator and demo == p.solution
                 else demo for p, demo in zip(problems, demos)]
    return {
        "sft": [{"messages": [{"role": "user", "content": p.question},
                              {"role": "assistant", "content": demo}]} for p, demo in zip(problems, demos)],
        "prefs": [{"prompt": p.question, "chosen": p.solution, "rejected": wrong_solution(p, rng, d)}
                  for p in problems],
        "prompts": [{"prompt": p.question, "answer": str(p.answer)} for p in problems],
    }


def write_synthetic_dataset(out_dir: str, task: SyntheticConfig, seed: int) -> dict[str, str]:
    """Write the six JSONL files (+ meta.json) into out_dir atomically; return {file name: path}.

    Deterministic in (task, seed): the stages pass `data.synthetic` and `data.seed` (else
    `train.seed`), and so does `megarl synthetic`. The test split's questions never occur in
    the train split.
    """
    n_train, n_test = task.n_train, task.n_test
    problems = generate_problems(n_train + n_test, seed, task)
    splits = {"train": problems[n_test:], "test": problems[:n_test]}
    with atomic_directory(out_dir, last=("meta.json",)) as tmp:
        for split, probs in splits.items():
            mistakes = task.sft_mistakes if split == "train" else 0.0  # held-out demonstrations stay right
            for view, rows in records(probs, seed + (split == "test"), task, mistakes).items():
                with open(os.path.join(tmp, f"{split}_{view}.jsonl"), "w") as f:
                    f.writelines(json.dumps(r) + "\n" for r in rows)
        meta = {"task": "synthetic_arithmetic", "seed": seed, "n_train": n_train, "n_test": n_test,
                "difficulty": difficulty(task)}
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(meta, f, indent=1)
    return {name: os.path.join(out_dir, name) for name in FILES}
