"""The synthetic arithmetic task: deterministic, checkable, short; the GSM8K answer checker."""
import json
import os
import random

import pytest

from megarl.data import synthetic
from megarl.data.answers import canonical_number, extract_answer, is_correct
from megarl.data.datasets import build_preference_dataset, build_prompt_dataset, build_sft_dataset
from megarl.data.errors import DataError
from megarl.config import SyntheticConfig
from megarl.data.synthetic import generate_problems, wrong_solution, write_synthetic_dataset
from megarl.data.tokenizer import ByteTokenizer


def read(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_extract_answer_and_is_correct():
    assert extract_answer("3+4=7\n#### 7") == "7"
    assert extract_answer("#### 1,234.50") == "1234.5"
    assert extract_answer("x #### 3 then #### -12.") == "-12"
    assert extract_answer("#### $18") == "18"
    assert extract_answer("#### 7.0 apples") == "7"
    assert extract_answer("the answer is 7") is None
    assert extract_answer("#### seven") is None
    assert canonical_number("0.50") == "0.5" and canonical_number("abc") is None
    assert is_correct("3+4=7\n#### 7", "7") and is_correct("#### 7", 7) and is_correct("#### 72", "...\n#### 72")
    assert is_correct("#### 1,000", "1000")
    assert not is_correct("#### 8", "7") and not is_correct("7", "7") and not is_correct("#### 7", "seven")


def test_problems_are_deterministic_and_solutions_check_out():
    d = SyntheticConfig(min_ops=1, max_ops=3, max_operand=12, ops="+-*")
    a, b = generate_problems(200, seed=5, task=d), generate_problems(200, seed=5, task=d)
    assert a == b and a != generate_problems(200, seed=6, task=d)
    assert len({p.question for p in a}) == 200
    for p in a:
        assert 1 <= len(p.steps) <= 3 and p.answer >= 0
        assert is_correct(p.solution, p.answer)
        for left, op, right, result in p.steps:
            assert result == eval(f"{left}{op}{right}")  # noqa: S307 - our own digits and + - *
        for rejects in ("operand", "slip"):
            wrong = wrong_solution(p, random.Random(0), SyntheticConfig(ops="+-*", max_operand=12, rejects=rejects))
            assert extract_answer(wrong) is not None and not is_correct(wrong, p.answer)
            assert wrong.count("\n") == p.solution.count("\n")  # same shape: a mistake, not garbage
            arithmetic_right = all(eval(line.replace("=", "==")) for line in wrong.split("\n")[:-1])  # noqa: S307
            if rejects == "slip":
                assert not arithmetic_right
            elif not _operand_fallback(p):
                assert arithmetic_right  # a misread quantity, computed correctly


def _operand_fallback(p):
    """Problems whose every step admits no other operand (e.g. "2-1") slip instead."""
    return any(op == "-" and left == 1 or op == "*" and left == 0 for left, op, right, _ in p.steps)


def test_operand_and_slip_rejects():
    p = generate_problems(1, seed=3, task=SyntheticConfig(min_ops=1, max_ops=1, ops="+", max_operand=9))[0]
    (a, _, b, c), = p.steps
    operand = wrong_solution(p, random.Random(1), SyntheticConfig(rejects="operand"))
    slip = wrong_solution(p, random.Random(1), SyntheticConfig(rejects="slip"))
    left, rest = operand.split("\n")[0].split("+")
    b2, c2 = map(int, rest.split("="))
    assert int(left) == a and b2 != b and c2 == a + b2  # misread quantity, right arithmetic
    left, rest = slip.split("\n")[0].split("+")
    b3, c3 = map(int, rest.split("="))
    assert (int(left), b3) == (a, b) and c3 != c  # right quantities, wrong sum


def test_difficulty_knobs_and_errors():
    easy = generate_problems(50, seed=0, task=SyntheticConfig(min_ops=1, max_ops=1, max_operand=5, ops="+"))
    assert all(len(p.steps) == 1 and p.steps[0][1] == "+" and p.answer <= 10 for p in easy)
    with pytest.raises(DataError, match="only .* distinct problems"):
        generate_problems(10_000, seed=0, task=SyntheticConfig(min_ops=1, max_ops=1, max_operand=2, ops="+"))
    with pytest.raises(DataError, match="subset of"):
        generate_problems(5, 0, task=SyntheticConfig(ops="/"))
    with pytest.raises(DataError, match="rejects must be one of operand, slip"):
        generate_problems(5, 0, task=SyntheticConfig(rejects="typo"))
    with pytest.raises(DataError, match="min_ops <= max_ops"):
        generate_problems(5, 0, task=SyntheticConfig(min_ops=3, max_ops=2))


def test_write_dataset_files_split_and_loaders(tmp_path):
    out = tmp_path / "syn"
    paths = write_synthetic_dataset(str(out), SyntheticConfig(n_train=300, n_test=50), seed=1)
    assert sorted(os.listdir(out)) == sorted(synthetic.FILES + ("meta.json",))
    sft_train, sft_test = read(paths["train_sft.jsonl"]), read(paths["test_sft.jsonl"])
    assert len(sft_train) == 300 and len(sft_test) == 50
    train_q = {r["messages"][0]["content"] for r in sft_train}
    assert not train_q & {r["messages"][0]["content"] for r in sft_test}  # held-out questions
    for name in ("train", "test"):
        prompts, prefs = read(paths[f"{name}_prompts.jsonl"]), read(paths[f"{name}_prefs.jsonl"])
        for s, p, q in zip(read(paths[f"{name}_sft.jsonl"]), prompts, prefs):
            assert s["messages"][0]["content"] == p["prompt"] == q["prompt"]
            assert is_correct(s["messages"][1]["content"], p["answer"]) and q["chosen"] == s["messages"][1]["content"]
            assert not is_correct(q["rejected"], p["answer"])
    # Same seed, same bytes (written again over the existing directory).
    before = {n: open(paths[n]).read() for n in synthetic.FILES}
    write_synthetic_dataset(str(out), SyntheticConfig(n_train=300, n_test=50), seed=1)
    assert before == {n: open(paths[n]).read() for n in synthetic.FILES}
    assert not [n for n in os.listdir(tmp_path) if n != "syn"]  # no temporary left behind
    # Default difficulty fits a 128-token byte-level context: nothing skipped.
    tok = ByteTokenizer()
    assert len(build_sft_dataset(paths["train_sft.jsonl"], tok, seq_len=128)) == 300
    assert len(build_preference_dataset(paths["train_prefs.jsonl"], tok, seq_len=128)) == 300
    prompts = build_prompt_dataset(paths["test_prompts.jsonl"], tok, max_prompt_len=128)
    assert prompts[0]["answer"] == read(paths["test_prompts.jsonl"])[0]["answer"]


def test_sft_mistakes_noisy_train_demonstrations_only(tmp_path):
    """sft_mistakes: that share of the train split's demonstrations carry one mistake of the
    `rejects` kind (the answer is wrong, the shape is kept); the held-out split, the preference
    pairs and the prompts are the same bytes as without it."""
    clean = write_synthetic_dataset(str(tmp_path / "clean"), SyntheticConfig(n_train=600, n_test=50), seed=4)
    noisy = write_synthetic_dataset(str(tmp_path / "noisy"), SyntheticConfig(n_train=600, n_test=50, sft_mistakes=0.3),
                                    seed=4)
    for name in synthetic.FILES:
        if name != "train_sft.jsonl":
            assert open(clean[name]).read() == open(noisy[name]).read(), name
    prompts = read(noisy["train_prompts.jsonl"])
    demos = [r["messages"][1]["content"] for r in read(noisy["train_sft.jsonl"])]
    wrong = [not is_correct(d, p["answer"]) for d, p in zip(demos, prompts)]
    assert 0.25 < sum(wrong) / len(wrong) < 0.35
    for d, r, w in zip(demos, read(clean["train_sft.jsonl"]), wrong):
        right = r["messages"][1]["content"]
        assert (d != right) == w and d.count("\n") == right.count("\n")  # the same lines
    assert json.load(open(os.path.join(tmp_path, "noisy", "meta.json")))["difficulty"]["sft_mistakes"] == 0.3
    with pytest.raises(DataError, match="sft_mistakes"):
        generate_problems(5, 0, task=SyntheticConfig(sft_mistakes=1.0))


def test_failed_write_leaves_nothing(tmp_path, monkeypatch):
    def boom(*args):
        raise RuntimeError("disk full")

    monkeypatch.setattr(synthetic, "records", boom)
    with pytest.raises(RuntimeError):
        write_synthetic_dataset(str(tmp_path / "syn"), SyntheticConfig(n_train=10, n_test=2), seed=0)
    assert os.listdir(tmp_path) == []


def test_run_dir_task_is_written_once_and_guarded(tmp_path):
    """Stages of one run dir share its synthetic task; other settings later are a one-line error."""
    from megarl.config import ConfigError, load_config
    from megarl.trainers.data_setup import _synthetic_task

    out = str(tmp_path / "data")
    base = ["data.synthetic.n_train=40", "data.synthetic.n_test=8"]
    _synthetic_task(load_config("configs/tiny_sft.yaml", base), out)
    with open(os.path.join(out, "meta.json")) as f:
        assert json.load(f)["difficulty"]["rejects"] == "operand"
    before = sorted(os.listdir(out))
    _synthetic_task(load_config("configs/tiny_rm.yaml", base), out)  # same settings: reused
    with pytest.raises(ConfigError, match=r"other settings \(synthetic.rejects=operand\)") as e:
        _synthetic_task(load_config("configs/tiny_rm.yaml", [*base, "data.synthetic.rejects=slip"]), out)
    assert "\n" not in str(e.value) and sorted(os.listdir(out)) == before


def test_cli_synthetic_defaults_write_the_stages_task(tmp_path):
    """`megarl synthetic` writes, byte for byte, the task a stage run with the same config writes
    to <run_dir>/data (same schema, same seed); without --config the flags set the same task; a
    flag changes it."""
    from megarl_run import megarl

    from megarl.config import load_config
    from megarl.trainers.data_setup import _synthetic_task

    stage_dir = tmp_path / "stage"
    _synthetic_task(load_config("configs/tiny_sft.yaml"), str(stage_dir))
    megarl(["synthetic", "--out", str(tmp_path / "cli"), "--config", "configs/tiny_sft.yaml"])
    megarl(["synthetic", "--out", str(tmp_path / "flags"), "--sft-mistakes", "0.3"])  # tiny_sft's
    megarl(["synthetic", "--out", str(tmp_path / "other"), "--seed", "7"])
    megarl(["synthetic", "--out", str(tmp_path / "clean"), "--config", "configs/tiny_sft.yaml", "--sft-mistakes", "0"])
    for name in (*synthetic.FILES, "meta.json"):
        stage = (stage_dir / name).read_bytes()
        assert (tmp_path / "cli" / name).read_bytes() == (tmp_path / "flags" / name).read_bytes() == stage, name
        assert (tmp_path / "other" / name).read_bytes() != stage, name
        assert ((tmp_path / "clean" / name).read_bytes() == stage) == (name not in ("train_sft.jsonl", "meta.json"))
    out = megarl(["synthetic", "--out", str(tmp_path / "bad"), "--n-train", "-5"], check=False)
    assert out.returncode == 2 and "n_train >= 1" in out.stderr and not (tmp_path / "bad").exists()
