"""Dataset formats and bad-record handling: one clear `path:line: problem` per bad record."""
import json
import logging
import os

import pytest

from megarl.data.datasets import build_preference_dataset, build_prompt_dataset, build_sft_dataset
from megarl.data.errors import DataError, Report
from megarl.data.formats import read_preferences, read_prompts, read_sft
from megarl.data.tokenizer import ByteTokenizer

TOK = ByteTokenizer()
GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


def write_lines(tmp_path, lines, name="train.jsonl"):
    path = tmp_path / name
    path.write_text("".join((ln if isinstance(ln, str) else json.dumps(ln)) + "\n" for ln in lines))
    return str(path)


# (bad line, kind counted under "skip", text the one-line error must contain)
BAD_SFT = [
    ('{"messages": [', "invalid_json", "invalid JSON"),
    ('[1, 2]', "wrong_type", "expected a JSON object, got list"),
    ({"text": "hello"}, "missing_field", "missing field 'messages'"),
    ({"prompt": "2+2?"}, "missing_field", "missing field 'completion'"),
    ({"prompt": "2+2?", "completion": "  "}, "empty_field", "field 'completion' is empty"),
    ({"messages": []}, "empty_field", "field 'messages' is an empty list"),
    ({"messages": "hi"}, "wrong_type", "field 'messages' must be a string or a list of messages, got string"),
    ({"prompt": 7, "completion": "x"}, "wrong_type",
     "field 'prompt' must be a string or a list of messages, got number"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "yo"}]},
     "unknown_role", "messages[1] has unknown role 'bot'"),
    ({"messages": [{"role": "user"}]}, "missing_field", "messages[0] has no 'content'"),
    ({"messages": [{"role": "user", "content": ["a"]}]}, "wrong_type",
     "messages[0].content must be a string, got list"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "bad_messages", "no assistant message"),
    ({"question": "What?", "answer": ""}, "empty_field", "field 'answer' is empty"),
    ({"messages": [{"role": "system", "content": "be brief"}, {"role": "assistant", "content": "hello"}]},
     "bad_messages", "messages has no user message; a conversation needs at least one user turn"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "system", "content": "late"},
                   {"role": "assistant", "content": "hello"}]},
     "bad_messages", "messages[1] is a system message; a system message may only come first"),
]


@pytest.mark.parametrize("bad,kind,text", BAD_SFT, ids=[f"{k}-{i}" for i, (_, k, _) in enumerate(BAD_SFT)])
def test_each_bad_sft_record_is_one_line_error_naming_file_and_line(tmp_path, bad, kind, text):
    path = write_lines(tmp_path, [GOOD, GOOD, bad, GOOD])
    with pytest.raises(DataError) as e:
        build_sft_dataset(path, TOK, seq_len=64)
    msg = str(e.value)
    assert msg.startswith(f"{path}:3: ") and text in msg and "\n" not in msg, msg
    assert isinstance(e.value, ValueError)
    # Under "skip" the same record is counted under its kind and the rest is kept.
    ds = build_sft_dataset(path, TOK, seq_len=64, policy="skip")
    assert len(ds) == 3 and dict(ds.report.skipped) == {kind: 1}


def test_too_long_after_tokenisation(tmp_path):
    long = {"prompt": "x" * 100, "completion": "y"}
    path = write_lines(tmp_path, [GOOD, long])
    with pytest.raises(DataError, match=rf"^{path}:2: too long after tokenisation: \d+ tokens > 64$"):
        build_sft_dataset(path, TOK, seq_len=64)


def test_invalid_utf8_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(json.dumps(GOOD).encode() + b"\n" + b'{"prompt": "\xff\xfe"}\n')
    with pytest.raises(DataError, match=rf"^{path}:2: not valid UTF-8"):
        build_sft_dataset(str(path), TOK, seq_len=64)


def test_skip_policy_summary_counts_each_kind_and_blank_lines(tmp_path, caplog):
    lines = [GOOD] * 5 + ["{bad json", "{also bad", "   ", "", {"prompt": "q" * 200, "completion": "a"},
                          {"messages": [{"role": "robot", "content": "x"}]}, ""]
    path = write_lines(tmp_path, lines)
    with caplog.at_level(logging.WARNING, logger="megarl.data"):
        ds = build_sft_dataset(path, TOK, seq_len=64, policy="skip")
    expected = f"{path}: kept 5 of 9 records; skipped 2 invalid_json, 1 too_long, 1 unknown_role; 3 blank lines (lines 8, 9, 12)"
    assert ds.report.summary() == expected
    assert expected in caplog.text
    assert ds.report.as_dict()["kept"] == 5


def test_blank_lines_are_counted_even_under_fail(tmp_path, caplog):
    path = write_lines(tmp_path, ["", GOOD, "  \t", GOOD])
    with caplog.at_level(logging.WARNING, logger="megarl.data"):
        ds = build_sft_dataset(path, TOK, seq_len=64)
    assert len(ds) == 2 and ds.report.blank == 2
    assert f"{path}: kept 2 of 2 records; 2 blank lines (lines 1, 3)" in caplog.text


def test_missing_file_and_bad_policy_and_nothing_left(tmp_path):
    missing = str(tmp_path / "nope.jsonl")
    with pytest.raises(DataError, match=rf"^data file not found: {missing}$"):
        build_sft_dataset(missing, TOK, seq_len=64)
    with pytest.raises(DataError, match="unknown bad-record policy 'ignore'"):
        build_sft_dataset(write_lines(tmp_path, [GOOD]), TOK, seq_len=64, policy="ignore")
    path = write_lines(tmp_path, ["{x", ""], name="all_bad.jsonl")
    with pytest.raises(DataError, match="kept 0 of 1 records; skipped 1 invalid_json; 1 blank line \\(line 2\\): no usable records"):
        build_sft_dataset(path, TOK, seq_len=64, policy="skip")


def test_sft_conventions_normalise_to_messages(tmp_path):
    lines = [
        GOOD,
        {"prompt": "2+2?", "completion": "4"},
        {"prompt": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"}],
         "completion": [{"role": "assistant", "content": "4"}]},
        {"question": "Natalia sold 48 clips. How many?", "answer": "She sold 48/2 = <<48/2=24>>24.\n#### 72"},
    ]
    recs = read_sft(write_lines(tmp_path, lines), Report("x"))
    assert [r.line for r in recs] == [1, 2, 3, 4]
    assert recs[1].messages == [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    assert [m["role"] for m in recs[2].messages] == ["system", "user", "assistant"]
    assert recs[3].messages[1]["content"].endswith("#### 72")  # GSM8K: the worked solution is the target


def test_preference_formats(tmp_path):
    conv = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    lines = [
        {"prompt": "q", "chosen": "good", "rejected": "bad"},
        {"chosen": conv, "rejected": conv[:1] + [{"role": "assistant", "content": "b"}]},
        {"prompt": [{"role": "user", "content": "q"}], "chosen": [{"role": "assistant", "content": "good"}],
         "rejected": [{"role": "assistant", "content": "bad"}]},
    ]
    recs = read_preferences(write_lines(tmp_path, lines), Report("x"))
    assert recs[0].chosen == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "good"}]
    assert recs[1].rejected[-1]["content"] == "b"
    assert recs[2].rejected == recs[0].rejected
    bad = write_lines(tmp_path, [lines[0], {"chosen": "good", "rejected": "bad"},
                                 {"prompt": "q", "chosen": "good", "rejected": ""}], name="bad.jsonl")
    with pytest.raises(DataError, match=r":2: missing field 'prompt'"):
        build_preference_dataset(bad, TOK, seq_len=64)
    ds = build_preference_dataset(bad, TOK, seq_len=64, policy="skip")
    assert len(ds) == 1 and dict(ds.report.skipped) == {"missing_field": 1, "empty_field": 1}
    long = write_lines(tmp_path, [{"prompt": "q", "chosen": "a", "rejected": "b" * 100}], name="long.jsonl")
    with pytest.raises(DataError, match=r":1: rejected is too long after tokenisation: \d+ tokens > 64"):
        build_preference_dataset(long, TOK, seq_len=64)


def test_prompt_formats_and_gsm8k_answers(tmp_path):
    lines = [
        {"prompt": "2+2?", "answer": "4"},
        {"prompt": "no answer"},
        {"prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}], "answer": 7},
        {"question": "Natalia sold 48 clips...", "answer": "48/2 = <<48/2=24>>24\n48+24 = <<48+24=72>>72\n#### 72"},
        {"question": "Big?", "answer": "It is\n#### 1,000"},
    ]
    recs = read_prompts(write_lines(tmp_path, lines), Report("x"))
    assert [r.answer for r in recs] == ["4", None, "7", "72", "1000"]
    assert recs[3].messages == [{"role": "user", "content": "Natalia sold 48 clips..."}]
    bad = write_lines(tmp_path, [{"question": "q", "answer": "no final number"}], name="gsm_bad.jsonl")
    with pytest.raises(DataError, match=r":1: GSM8K field 'answer' does not end with '#### <number>'"):
        build_prompt_dataset(bad, TOK, max_prompt_len=64)
    ends_assistant = write_lines(tmp_path, [{"prompt": [{"role": "user", "content": "u"},
                                                        {"role": "assistant", "content": "a"}]}], name="pa.jsonl")
    with pytest.raises(DataError, match=r":1: prompt must end with a user message"):
        build_prompt_dataset(ends_assistant, TOK, max_prompt_len=64)
    wrong = write_lines(tmp_path, [{"prompt": "p", "answer": [1]}], name="pw.jsonl")
    with pytest.raises(DataError, match=r":1: field 'answer' must be a string or number, got list"):
        build_prompt_dataset(wrong, TOK, max_prompt_len=64)


def test_prompt_bare_strings_and_bad_prompts_named_by_line(tmp_path, caplog):
    lines = ['"What is 2+2?"', {"prompt": "p", "answer": 3}, "", {"answer": "5"}, '"  "', "7",
             {"question": "q", "answer": "Work.\n#### 1,000"}, "", "", "", "", "", "", '"last"']
    path = write_lines(tmp_path, lines, name="rl.jsonl")
    report = Report(path, "skip")
    recs = read_prompts(path, report)
    assert [(r.line, r.messages[0]["content"], r.answer) for r in recs] == [
        (1, "What is 2+2?", None), (2, "p", "3"), (7, "q", "1000"), (14, "last", None)]
    assert report.summary() == (f"{path}: kept 4 of 7 records; skipped 1 empty_field, 1 missing_field, "
                                f"1 wrong_type; 7 blank lines (lines 3, 8, 9, 10, 11, ...)")
    for bad, msg in [({"answer": "5"}, ":1: missing field 'prompt' \\(or GSM8K 'question'\\+'answer'\\)"),
                     ('"  "', ":1: prompt string is empty"), ("7", ":1: expected a JSON object or string, got number"),
                     ("[1]", ":1: expected a JSON object or string, got list")]:
        with pytest.raises(DataError, match=msg):
            read_prompts(write_lines(tmp_path, [bad], name="one.jsonl"), Report("x"))
    ds = build_prompt_dataset(write_lines(tmp_path, ['"hi"', "", '"there"'], name="two.jsonl"), TOK,
                              max_prompt_len=64)
    assert len(ds) == 2 and ds.report.blank_lines == [2]


def test_plain_text_prompt_file(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("What is 2+2?\n\nName a colour.\n")
    ds = build_prompt_dataset(str(path), TOK, max_prompt_len=64)
    assert len(ds) == 2 and ds.report.blank == 1
    assert ds[1]["messages"] == [{"role": "user", "content": "Name a colour."}] and ds[1]["answer"] is None
    assert TOK.decode(ds[0]["prompt_ids"]).endswith("<|im_start|>assistant\n")


def test_gsm8k_file_loads_as_sft_and_as_prompts(tmp_path):
    rows = [{"question": "Weng earns $12 an hour. She did 50 minutes. How much did she earn?",
             "answer": "12/60 = $<<12/60=0.2>>0.2 per minute.\n0.2 x 50 = $<<0.2*50=10>>10.\n#### 10"},
            {"question": "Betty needs $100...", "answer": "She has 100/2 = $<<100/2=50>>50.\n#### 5"}]
    path = write_lines(tmp_path, rows, name="gsm8k_test.jsonl")
    sft = build_sft_dataset(path, TOK, seq_len=256)
    assert len(sft) == 2
    text = TOK.decode(sft[0]["tokens"])
    assert "<|im_start|>assistant\n12/60" in text and text.endswith("#### 10<|im_end|>")
    prompts = build_prompt_dataset(path, TOK, max_prompt_len=256)
    assert [prompts[i]["answer"] for i in range(2)] == ["10", "5"]
    assert os.path.basename(path) in prompts.report.summary()


EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "configs", "data")


def test_example_files_load():
    assert len(build_sft_dataset(os.path.join(EXAMPLES, "sft_example.jsonl"), TOK, seq_len=512)) == 3
    assert len(build_preference_dataset(os.path.join(EXAMPLES, "prefs_example.jsonl"), TOK, seq_len=512)) == 2
    prompts = build_prompt_dataset(os.path.join(EXAMPLES, "prompts_example.jsonl"), TOK, max_prompt_len=512)
    assert [prompts[i]["answer"] for i in range(3)] == ["7", "7", None]
    assert len(build_prompt_dataset(os.path.join(EXAMPLES, "prompts_example.txt"), TOK, max_prompt_len=512)) == 2


def test_fail_error_has_no_chained_traceback(tmp_path):
    with pytest.raises(DataError) as e:
        build_sft_dataset(write_lines(tmp_path, ["{oops"]), TOK, seq_len=64)
    assert e.value.__suppress_context__ or e.value.__context__ is None


def test_identical_preference_pair_and_conversation_rules(tmp_path):
    good = {"prompt": "q", "chosen": "good", "rejected": "bad"}
    same = {"prompt": "q", "chosen": "same", "rejected": "same"}
    late_system = {"chosen": [{"role": "user", "content": "q"}, {"role": "system", "content": "s"},
                              {"role": "assistant", "content": "a"}],
                   "rejected": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "b"}]}
    path = write_lines(tmp_path, [good, same, late_system, good])
    with pytest.raises(DataError) as e:
        build_preference_dataset(path, TOK, seq_len=64)
    assert str(e.value) == f"{path}:2: chosen and rejected are the same; the pair has no preference to learn"
    ds = build_preference_dataset(path, TOK, seq_len=64, policy="skip")
    assert len(ds) == 2 and dict(ds.report.skipped) == {"identical_pair": 1, "bad_messages": 1}
