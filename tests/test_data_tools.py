"""Tool calls in SFT data: GSM8K's `<<48/2=24>>` is a call (trained) and an observation (masked),
tokenised as the rollout tokenises it; the synthetic task's calculator demonstrations."""
import json

import pytest

from chat_templates import CHATML_TEMPLATE, LLAMA3_TEMPLATE, make_tiny_hf_tokenizer
from megarl.config import SyntheticConfig
from megarl.data import synthetic
from megarl.data.answers import is_correct
from megarl.data.chat import tool_segments
from megarl.data.datasets import build_sft_dataset
from megarl.data.tokenizer import ByteTokenizer, HFTokenizer
from megarl.rollout.tools import Calculator, PythonTool

GSM = "Natalia sold 48/2 = <<48/2=24>>24 clips.\nIn all 48+24 = <<48+24=72>>72.\n#### 72"
CONV = [{"role": "user", "content": "How many clips?"}, {"role": "assistant", "content": GSM}]


def test_segments_follow_the_tool_protocol():
    assert tool_segments(GSM) == [("Natalia sold 48/2 = <<48/2=", False), ("24>>", True),
                                  ("24 clips.\nIn all 48+24 = <<48+24=", False), ("72>>", True), ("72.\n#### 72", False)]
    # the data's markers are the tools' own: a call's observation is what the tool injects
    calc, py = Calculator(), PythonTool.__new__(PythonTool)
    assert (calc.call_open, calc.call_close, calc.result_open, calc.result_close) == ("<<", "=", "", ">>")
    assert calc.call("48/2").text == "24>>" and calc.call("48+24").text == "72>>"
    code = f"{py.call_open}print(6*7){py.call_close}"
    assert tool_segments(f"{code}{py.result_open}42\n{py.result_close} so 42") == [
        (code, False), ("<output>42\n</output>", True), (" so 42", False)]
    for text in ("a << b = c >> d", "x <<3*$5=15>> y", "3+4=7", "<<1=2\n>>"):  # not calculator calls
        assert tool_segments(text) == [(text, False)]


def test_byte_tokenizer_masks_observations_token_by_token():
    tok = ByteTokenizer()
    ids, mask = tok.encode_chat(CONV)
    assert tok.decode(ids).endswith(GSM + "<|im_end|>")
    start = len(ids) - len(GSM.encode()) - 1  # first assistant content byte
    want = []
    for piece, observed in tool_segments(GSM):
        want += [0 if observed else 1] * len(piece.encode())
    assert mask[start:] == want + [1] and not any(mask[:start])
    masked = bytes(i for i, m in zip(ids[start:-1], mask[start:-1]) if not m).decode()
    assert masked == "24>>72>>"


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    return {"chatml": HFTokenizer(make_tiny_hf_tokenizer(str(root / "chatml"), CHATML_TEMPLATE)),
            "llama3": HFTokenizer(make_tiny_hf_tokenizer(str(root / "llama3"), LLAMA3_TEMPLATE, eos_token="<|eot_id|>",
                                                         bos_token="<|begin_of_text|>"))}


@pytest.mark.parametrize("name", ["chatml", "llama3"])
def test_hf_tokenizer_encodes_observations_as_the_rollout_does(hf, name):
    tok = hf[name]
    ids, mask = tok.encode_chat(CONV)
    prompt, _ = tok.encode_chat(CONV[:1], add_generation_prompt=True)
    assert ids[: len(prompt)] == prompt and not any(mask[: len(prompt)])
    # the response is piece by piece: the rollout's sampled call, then encode(observation), ...
    pieces = [(tok.encode(p), o) for p, o in tool_segments(GSM)]
    body = [i for p, _ in pieces for i in p]
    assert ids[len(prompt): len(prompt) + len(body)] == body
    want = [0 if o else 1 for p, o in pieces for _ in p]
    assert mask[len(prompt): len(prompt) + len(body)] == want
    assert ids[len(prompt) + len(body)] in tok.stop_ids and mask[len(prompt) + len(body)] == 1
    # conversations without observations are tokenised as before
    plain = [CONV[0], {"role": "assistant", "content": "48/2 = 24\n#### 24"}]
    from megarl.data.chat import assistant_mask_by_prefixes

    assert tok.encode_chat(plain) == assistant_mask_by_prefixes(tok.render_chat, tok.encode, plain, set(tok.stop_ids))


def test_gsm8k_sft_dataset_masks_observations(tmp_path):
    path = tmp_path / "gsm8k.jsonl"
    path.write_text(json.dumps({"question": "How many clips?", "answer": GSM}) + "\n")
    tok = ByteTokenizer()
    item = build_sft_dataset(str(path), tok, seq_len=256)[0]
    text = tok.decode(item["tokens"])
    assert GSM in text
    learned = bytes(int(t) for t, m in zip(item["tokens"], item["target_mask"]) if m and t < 256).decode()
    assert "24>>" not in learned and "<<48/2=" in learned and learned.endswith("#### 72")


def test_synthetic_calculator_demonstrations(tmp_path):
    base = dict(n_train=400, n_test=50, ops="+-*", max_factor=99, max_operand=20)
    plain = synthetic.write_synthetic_dataset(str(tmp_path / "plain"), SyntheticConfig(**base), seed=2)
    off = synthetic.write_synthetic_dataset(str(tmp_path / "off"), SyntheticConfig(**base, calculator=0.0), seed=2)
    tools = synthetic.write_synthetic_dataset(str(tmp_path / "tools"), SyntheticConfig(**base, calculator=0.5), seed=2)
    for name in synthetic.FILES:  # off: the very bytes of a task without the option
        assert open(plain[name]).read() == open(off[name]).read(), name
    with open(tmp_path / "plain" / "meta.json") as a, open(tmp_path / "off" / "meta.json") as b:
        assert a.read() == b.read()
    with open(tmp_path / "tools" / "meta.json") as f:
        assert json.load(f)["difficulty"]["calculator"] == 0.5
    for name in synthetic.FILES:
        if not name.endswith("_sft.jsonl"):
            assert open(plain[name]).read() == open(tools[name]).read(), name
    calc, tok = Calculator(), ByteTokenizer()
    with_products = with_calls = 0
    for split in ("train", "test"):
        prompts = [json.loads(x) for x in open(tools[f"{split}_prompts.jsonl"])]
        for line, p, q in zip(open(tools[f"{split}_sft.jsonl"]), prompts, open(plain[f"{split}_sft.jsonl"])):
            demo, before = json.loads(line)["messages"][1]["content"], json.loads(q)["messages"][1]["content"]
            assert is_correct(demo, p["answer"])
            has_product = "*" in before
            with_products += has_product
            if demo != before:
                with_calls += 1
                assert demo.replace("<<", "").replace(">>", "") == before  # the same steps, products as calls
                segs = tool_segments(demo)
                calls = [(a, b) for (a, _), (b, o) in zip(segs, segs[1:]) if o]
                assert calls and all(calc.call(a.rsplit("<<", 1)[1][:-1]).text == b for a, b in calls)
                ids, mask = tok.encode_chat(json.loads(line)["messages"])
                assert sum(1 - m for m in mask[-len(demo.encode()) - 1:]) == sum(len(b) for _, b in calls)
            else:
                assert "<<" not in demo
    assert 0.4 < with_calls / with_products < 0.6
    with pytest.raises(synthetic.DataError, match="calculator"):
        synthetic.generate_problems(5, 0, task=SyntheticConfig(calculator=1.5))
