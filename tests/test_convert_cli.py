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
            "--arch", "llama", "--config", str(cfg)])
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
    model = [o for o in TINY if not o.startswith("model.")] + [
        "model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128", "model.num_attention_heads=4",
        "model.num_kv_heads=2", "model.max_position_embeddings=256", f"model.init_from={hf_llama}"]
    out = megarl(["rm", "--config", "configs/tiny_rm.yaml", f"train.run_dir={tmp_path}", *model, "train.steps=2",
                  "train.eval_interval=0", "reward_model.init_from=null"])
    assert f"reward model backbone initialised from {hf_llama}" in out.stdout
