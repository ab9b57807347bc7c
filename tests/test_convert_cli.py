"""`megarl convert` both ways through the real CLI, and model.init_from an imported model."""
import pytest
import torch

from megarl_run import TINY, megarl

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=261, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      rope_theta=10000.0, tie_word_embeddings=False)
    d = tmp_path_factory.mktemp("hf")
    LlamaForCausalLM(cfg).save_pretrained(d, safe_serialization=True)
    return d


def _tensors(d):
    from safetensors.torch import load_file

    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def test_hf_to_megarl_to_hf_is_bit_exact(tmp_path, hf_llama):
    megarl(["convert", "hf-to-megarl", "--hf", str(hf_llama), "--out", str(tmp_path / "ckpt")])
    assert (tmp_path / "ckpt" / "latest").exists() and (tmp_path / "ckpt" / "config.yaml").exists()
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text((tmp_path / "ckpt" / "config.yaml").read_text())
    megarl(["convert", "megarl-to-hf", "--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "back"),
            "--arch", "llama", "--config", str(cfg), "tokenizer.kind=byte"])  # hf_llama has no tokenizer
    a, b = _tensors(hf_llama), _tensors(tmp_path / "back")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_sft_starts_from_imported_weights_and_exports(tmp_path, hf_llama):
    megarl(["convert", "hf-to-megarl", "--hf", str(hf_llama), "--out", str(tmp_path / "ckpt")])
    run = tmp_path / "run"
    model = [o for o in TINY if not o.startswith("model.")] + [
        "model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128", "model.num_attention_heads=4",
        "model.num_kv_heads=2", "model.max_position_embeddings=256", f"model.init_from={tmp_path / 'ckpt'}"]
    megarl(["sft", "--config", "configs/tiny_sft.yaml", f"train.run_dir={run}", *model, "train.steps=2",
            "train.eval_interval=0"])
    # the stage's own config.yaml is found next to its checkpoints
    megarl(["convert", "megarl-to-hf", "--checkpoint", str(run / "sft" / "checkpoints"), "--out", str(tmp_path / "hf2"),
            "--arch", "llama"])
    tuned = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf2")
    base = _tensors(hf_llama)
    moved = {k: (v - base[k]).abs().max().item() for k, v in tuned.state_dict().items() if k in base}
    assert max(moved.values()) > 0, "two SFT steps from the imported weights changed nothing"
    assert max(moved.values()) < 0.1, "the run did not start from the imported weights"


def test_reward_model_backbone_from_hf_directory(tmp_path, hf_llama):
    model = [o for o in TINY if not o.startswith("model.")] + [f"model.from_hf={hf_llama}", f"model.init_from={hf_llama}"]
    out = megarl(["rm", "--config", "configs/tiny_rm.yaml", f"train.run_dir={tmp_path}", *model, "train.steps=2",
                  "train.eval_interval=0", "reward_model.init_from=null"])
    assert f"reward model backbone initialised from {hf_llama}" in out.stdout


def _ends_every_reply(hf_dir, im_end: int) -> None:
    """Make the model in hf_dir put <|im_end|> first whatever it reads: the residual stream keeps
    a large constant in dimension 0 (attention and MLP outputs zeroed), which only im_end's
    lm_head row reads."""
    from safetensors.torch import load_file, save_file

    path = hf_dir / "model.safetensors"
    w = load_file(path)
    for k in w:
        if k.endswith(("o_proj.weight", "down_proj.weight")):
            w[k].zero_()
    w["model.embed_tokens.weight"][:, 0] = 30.0
    w["lm_head.weight"][:, 0] = 0.0
    w["lm_head.weight"][im_end, 0] = 1.0
    save_file(w, path, metadata={"format": "pt"})


def test_hf_export_generates_until_the_chat_end_token(tmp_path, hf_llama):
    """The export is usable as exported: AutoTokenizer equals megarl's byte tokenizer (ids and
    chat format), config.json/generation_config.json carry its special ids, so generate() stops
    at <|im_end|> (it ran past it to max_new_tokens with Llama's defaults, eos 2), and the files
    are readable as other outputs are (not 0700/0600)."""
    import json
    import os
    import random
    import shutil

    from megarl.data import ByteTokenizer

    tok = ByteTokenizer()
    src = tmp_path / "hf"
    shutil.copytree(hf_llama, src)
    _ends_every_reply(src, tok.im_end_id)
    megarl(["convert", "hf-to-megarl", "--hf", str(src), "--out", str(tmp_path / "ckpt")])
    out = tmp_path / "export"
    megarl(["convert", "megarl-to-hf", "--checkpoint", str(tmp_path / "ckpt"), "--out", str(out), "--arch", "llama",
            "tokenizer.kind=byte"])  # the HF directory has no tokenizer: the byte one, by name

    config = json.loads((out / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (tok.bos_id, tok.eos_id, tok.pad_id)
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [tok.im_end_id, tok.endoftext_id]

    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    rng = random.Random(0)
    text = "".join(rng.choice("az 09+-=\n\t\u00e9\u4e2d\U0001f600<|>") for _ in range(100))
    assert hf_tok.encode(text, add_special_tokens=False) == tok.encode(text)
    assert hf_tok.decode(tok.encode(text)) == text
    messages = [{"role": "user", "content": "What is 17 + 25?"}, {"role": "assistant", "content": "42"},
                {"role": "user", "content": "And 3 * 4?"}]
    prompt = tok.encode_chat(messages, add_generation_prompt=True)[0]
    assert list(hf_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                           return_dict=False)) == prompt

    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    ids = torch.tensor([prompt])
    generated = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False)
    assert generated[0, len(prompt):].tolist() == [tok.im_end_id]  # stopped at the end of the turn
    assert hf_tok.decode(generated[0, len(prompt):]) == "<|im_end|>"

    umask = os.umask(0o022)
    os.umask(umask)
    assert (out.stat().st_mode & 0o777) == 0o777 & ~umask
    for f in out.iterdir():
        assert (f.stat().st_mode & 0o777) == 0o666 & ~umask, f
