"""Rule rewards, reward-function loading, error isolation in scoring, and pass@k / mean@k."""
import logging
import math
import random
from fractions import Fraction

import pytest

from megarl.data.answers import extract_answer, last_number
from megarl.rewards import (RewardError, exact_match, final_answer, format_reward, gsm8k, load_reward_fn,
                            mean_at_k, mean_pass_at_k, pass_at_k, score_batch, weighted_sum)


# ------------------------------------------------------------------------------ answer parsing

@pytest.mark.parametrize("text, strict, fallback", [
    ("3+4=7\n#### 7", "7", "7"),
    ("#### $1,234.50", "1234.5", "1234.5"),
    ("#### 7.0 apples", "7", "7"),
    ("#### -12.", "-12", "-12"),
    ("The answer is 72.", None, "72"),
    ("She earned $1,000.00 in total", None, "1000"),
    ("so 5-3=2", None, "2"),                        # "-3" of "5-3" is not a negative number
    ("x = 10 - 4", None, "4"),
    ("it drops to -3 degrees", None, "-3"),
    ("the list 1,2,3", None, "3"),                  # commas only group thousands
    ("#### seven, or maybe 12", None, "12"),         # unparseable #### falls back
    ("#### 5 and later 9", "5", "5"),               # #### wins over the last number
    ("no digits here", None, None),
    ("x2 and y3", None, None),
])
def test_answer_extraction_with_and_without_fallback(text, strict, fallback):
    assert extract_answer(text) == strict
    assert extract_answer(text, fallback_last_number=True) == fallback
    if "####" not in text:
        assert last_number(text) == fallback


def test_rule_rewards():
    prompts = ["p"] * 6
    responses = ["work\n#### 1,000", "#### 72.0", "the answer is 72", "#### 71", "72", "#### -$0.50"]
    answers = ["1000", "Natalia...\n#### 72", "72", "72", "72", "-0.5"]
    assert final_answer(prompts, responses, answers) == [1.0, 1.0, 0.0, 0.0, 0.0, 1.0]
    assert gsm8k(prompts, responses, answers) == [1.0, 1.0, 1.0, 0.0, 1.0, 1.0]
    assert format_reward(prompts, responses, [None] * 6) == [1.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    both = weighted_sum([(gsm8k, 1.0), (format_reward, 0.25)])
    assert both(prompts, responses, answers) == [1.25, 1.25, 1.0, 0.25, 1.0, 1.25]
    assert exact_match(["p"] * 3, [" yes \n", "Yes", "72"], ["yes", "yes", "72.0"]) == [1.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="needs a reference answer"):
        gsm8k(["p"], ["#### 3"], [None])
    with pytest.raises(ValueError, match="reference answer 'yes' is not one"):
        final_answer(["p"], ["#### 3"], ["yes"])
    with pytest.raises(ValueError, match="term 1 must be"):
        weighted_sum([(gsm8k, 1.0), gsm8k])


# ------------------------------------------------------------------------------ loading

USER_MODULE = '''
def length_reward(prompts, responses, answers):
    return [len(r) / 10 for r in responses]

def picky(prompts, responses, answers):
    out = []
    for r in responses:
        if "boom" in r:
            raise KeyError("cannot parse " + r[:5])
        out.append(1.0 if "nan" not in r else float("nan"))
    return out

NOT_A_FUNCTION = 3
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_load_reward_fn(user_module):
    assert load_reward_fn("gsm8k") is gsm8k and load_reward_fn("format") is format_reward
    fn = load_reward_fn("my_rewards:length_reward")
    assert fn(["p"], ["abcde"], [None]) == [0.5]
    by_file = load_reward_fn(f"{user_module}/my_rewards.py:length_reward")
    assert by_file(["p"], ["abc"], [None]) == [pytest.approx(0.3)]
    mixed = load_reward_fn([["gsm8k", 1.0], {"fn": "my_rewards:length_reward", "weight": 2}])
    assert mixed(["p"], ["#### 4"], ["4"]) == [pytest.approx(1.0 + 2 * 0.6)]
    for spec, msg in [
        ("gsm9k", "unknown reward function 'gsm9k': expected a built-in"),
        ("no_such_module_xyz:f", "cannot import 'no_such_module_xyz': ModuleNotFoundError"),
        ("my_rewards:missing", "'my_rewards' has no attribute 'missing'"),
        ("my_rewards:NOT_A_FUNCTION", "is not callable"),
        ("/nonexistent/r.py:f", "file not found: /nonexistent/r.py"),
        ("", "must be a built-in name"),
        ([["gsm8k", "heavy"]], "weight must be a number"),
    ]:
        with pytest.raises(ValueError, match=msg):
            load_reward_fn(spec)


# ------------------------------------------------------------------------------ error isolation

def test_score_batch_isolates_failures(user_module, caplog):
    fn = load_reward_fn("my_rewards:picky")
    prompts = [f"prompt {i}" for i in range(10)]
    responses = ["ok"] * 10
    responses[3] = "boom: " + "x" * 500                         # raises
    responses[7] = "nan here"                                   # non-finite score
    with caplog.at_level(logging.WARNING, logger="megarl.rewards"):
        result = score_batch(fn, prompts, responses, [None] * 10, max_fail_fraction=0.2)
    assert result.scores == [1.0] * 3 + [0.0] + [1.0] * 3 + [0.0] + [1.0] * 2
    assert [f.index for f in result.failures] == [3, 7] and result.n_failed == 2
    assert "KeyError: 'cannot parse boom:'" in result.failures[0].error
    assert result.failures[0].prompt == "prompt 3" and result.failures[0].response.endswith("...")
    assert len(result.failures[0].response) == 203              # truncated to 200 + "..."
    assert "non-finite score nan" in result.failures[1].error
    assert "failed on sample 3: KeyError" in caplog.text and "prompt 'prompt 3'" in caplog.text
    # over the limit: one line naming the function, the counts and the first culprit
    with pytest.raises(RewardError) as e:
        score_batch(fn, prompts, responses, [None] * 10, max_fail_fraction=0.1)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("reward function 'picky' failed on 2 of 10 samples (more than max_fail_fraction=0.1); "
                          "first: sample 3: KeyError")
    # a clean batch scores in one call
    calls = []

    def counting(p, r, a):
        calls.append(len(r))
        return [1] * len(r)
    assert score_batch(counting, ["p"] * 4, ["r"] * 4, [None] * 4).scores == [1.0] * 4 and calls == [4]
    wrong_len = score_batch(lambda p, r, a: [1.0], ["p"] * 3, ["r"] * 3, [None] * 3, max_fail_fraction=1.0)
    assert wrong_len.scores == [1.0, 1.0, 1.0] and wrong_len.n_failed == 0   # per-sample calls succeed
    with pytest.raises(RewardError, match="failed on 3 of 3 samples.*needs a reference answer"):
        score_batch(gsm8k, ["p"] * 3, ["#### 1"] * 3, [None] * 3)
    with pytest.raises(ValueError, match="must be as many"):
        score_batch(gsm8k, ["p"], ["r", "s"], [None, None])


# ------------------------------------------------------------------------------ pass@k

@pytest.mark.parametrize("n, c, k, want", [
    (5, 2, 1, 2 / 5),          # 1 - C(3,1)/C(5,1)
    (5, 2, 2, 7 / 10),         # 1 - C(3,2)/C(5,2) = 1 - 3/10
    (5, 2, 3, 9 / 10),         # 1 - C(3,3)/C(5,3) = 1 - 1/10
    (5, 2, 4, 1.0),            # only 3 wrong samples: any 4 contain a right one
    (4, 1, 2, 1 / 2),          # 1 - C(3,2)/C(4,2) = 1 - 3/6
    (10, 0, 3, 0.0),
    (10, 10, 1, 1.0),
    (16, 3, 8, 1 - Fraction(math.comb(13, 8), math.comb(16, 8))),
])
def test_pass_at_k_hand_computed(n, c, k, want):
    assert pass_at_k(n, c, k) == pytest.approx(float(want), abs=1e-12)


def test_pass_at_k_large_n_matches_exact_binomials_and_averages():
    rng = random.Random(0)
    for _ in range(20):
        n = rng.randint(50, 400)
        c, k = rng.randint(0, n), rng.randint(1, n)
        exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k)) if n - c >= k else Fraction(1)
        assert pass_at_k(n, c, k) == pytest.approx(float(exact), abs=1e-12)
    correct = [[True, False, False, True], [False] * 4, [True] * 4]
    assert mean_pass_at_k(correct, 1) == pytest.approx((0.5 + 0 + 1) / 3)
    assert mean_pass_at_k(correct, 2) == pytest.approx((5 / 6 + 0 + 1) / 3)
    assert mean_at_k([[1.0, 0.0, 0.5], [0.25, 0.25, 0.25]], 3) == pytest.approx((0.5 + 0.25) / 2)
    for bad, msg in [((3, 4, 1), "0 <= c <= n"), ((3, 1, 0), "1 <= k <= n"), ((3, 1, 4), "1 <= k <= n"),
                     ((3.0, 1, 1), "n must be an int")]:
        with pytest.raises(ValueError, match=msg):
            pass_at_k(*bad)
    with pytest.raises(ValueError, match="prompt 1 has 1 samples, needs at least 2"):
        mean_at_k([[1, 0], [1]], 2)
