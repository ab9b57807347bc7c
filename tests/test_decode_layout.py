"""CPU generation reads each linear's weight from [in, out] memory (models/decode_layout.py) and
runs its GEMMs of 2+ rows through oneDNN, the LM head's at 1-32 rows through megarl._cpu where built
(models/cpu_gemm.py; the routed GEMM itself is tested in
tests/test_cpu_gemm.py): which weights switch and which linears are routed, that they come back
untouched (optimizer buffers included, exceptions included), and that generation is the same
model in every layout and library (fp32 rounding only)."""
import pytest
import torch

from dist_helpers import run_distributed

VOCAB, PAD = 100, 0


def _body(rank, world_size):
    from megarl.config import ModelConfig, OptimConfig, ParallelConfig
    from megarl.models import cpu_gemm, cpu_kernels, decode_layout
    from megarl.models.layout import unwrap
    from megarl.roles.role import Role
    from megarl.rollout.engine import MegatronRolloutEngine, SamplingParams
    from megarl.runtime.distributed import init_distributed, teardown

    init_distributed(1, 1, seed=3)
    # megarl._cpu's GEMM, where built: a wide weight's (the head's at 1-32 rows) calls of 2+ rows and
    # of 1 row, and any other weight's (layer_kernel: 1-64 rows)
    kernel, kernel_calls = cpu_kernels.wide_linear(), [0, 0, 0]

    def counting_kernel(x, w):
        i = 2 if w.shape[0] < cpu_gemm.OUT_MAJOR_MIN_OUT else int(x.shape[0] == 1)
        kernel_calls[i] += 1
        return kernel(x, w)

    cpu_kernels.wide_linear = lambda: kernel and counting_kernel
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in (3, 11, 6, 1)]
    out = {}
    for tied in (False, True):
        mc = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, num_kv_heads=2,
                         vocab_size=VOCAB, max_position_embeddings=48, init_std=0.1, tie_embeddings=tied)
        # tied: with the distributed optimizer, whose weights are views into one parameter buffer
        role = Role("actor", mc, ParallelConfig(distributed_optimizer=tied), head="lm", seed=5,
                    optim=OptimConfig(lr=1e-3))
        gpt = unwrap(role.model)
        names = {id(p): n for n, p in gpt.named_parameters()}
        weights = decode_layout.switchable_weights(role.chunks)
        before = [(w, w.untyped_storage().data_ptr(), w.data_ptr(), w.stride(), w.detach().clone()) for w in weights]
        inside = []
        with decode_layout.in_major_weights(role.chunks) as out_major:
            for w, _, ptr, _, values in before:
                kept = out_major[id(w)]  # the weight's own [out, in] tensor, handed to cpu_gemm
                inside.append((w.t().is_contiguous(), w.data_ptr() != ptr, torch.equal(w, values),
                               kept.data_ptr() == ptr and kept.is_contiguous() and torch.equal(kept, values)))

        def restored():  # the same memory (views into megatron's buffer stay views), layout and values
            return all(w.untyped_storage().data_ptr() == storage and w.data_ptr() == ptr and w.stride() == stride
                       and torch.equal(w, values) for w, storage, ptr, stride, values in before)

        was_restored = restored()
        try:
            with decode_layout.in_major_weights(role.chunks):
                raise KeyError("inside")
        except KeyError:
            pass
        restored_after_error = restored()

        linears = [m for m in gpt.modules() if type(m).__name__ in ("ColumnParallelLinear", "RowParallelLinear")]
        with cpu_gemm.cpu_linears(role.chunks, onednn=True) as routed:
            routed_inside = all("_forward_impl" in vars(m) for m in linears)
        try:
            with cpu_gemm.cpu_linears(role.chunks, onednn=True):
                raise KeyError("inside")
        except KeyError:
            pass
        routed_after = sum("_forward_impl" in vars(m) for m in linears)
        # without oneDNN (an Intel CPU) only a wide weight (the head; tied: handed per call) can take
        # the kernel: the layers keep megatron's path. At the default width and at one that makes
        # fc1 (192 outputs) count as wide too, not qkv (128) nor the head (VOCAB padded to 128).
        routed_no_onednn = []
        for wide in (cpu_gemm.OUT_MAJOR_MIN_OUT, 150):
            cpu_gemm.OUT_MAJOR_MIN_OUT, default_wide = wide, cpu_gemm.OUT_MAJOR_MIN_OUT
            try:
                with cpu_gemm.cpu_linears(role.chunks, onednn=False, out_major={-1: None},
                                          layer_kernel=False) as n_routed:
                    routed_no_onednn.append((n_routed, sorted(n.rsplit(".", 1)[-1] for n, m in gpt.named_modules()
                                                              if "_forward_impl" in vars(m))))
            finally:
                cpu_gemm.OUT_MAJOR_MIN_OUT = default_wide

        # with the layers' kernel (where built) every linear is wrapped, oneDNN or not
        with cpu_gemm.cpu_linears(role.chunks, onednn=False, out_major={-1: None}, layer_kernel=True) as n_routed:
            routed_layer_kernel = n_routed
        plain = MegatronRolloutEngine(role, vocab_size=VOCAB, pad_id=PAD, in_major_weights=False, onednn_linears=False)
        mkl = MegatronRolloutEngine(role, vocab_size=VOCAB, pad_id=PAD, onednn_linears=False, layer_kernel=False)
        fast = MegatronRolloutEngine(role, vocab_size=VOCAB, pad_id=PAD, onednn_linears=True, layer_kernel=False)
        layers = MegatronRolloutEngine(role, vocab_size=VOCAB, pad_id=PAD, onednn_linears=True, layer_kernel=True,
                                       native_layers=False)
        native = MegatronRolloutEngine(role, vocab_size=VOCAB, pad_id=PAD, onednn_linears=True, layer_kernel=True)
        greedy = SamplingParams(greedy=True, max_new_tokens=10)
        sampled = SamplingParams(n=3, temperature=1.0, max_new_tokens=10)
        runs, onednn_calls, head_mkl_calls, head_kernel_calls, head_kernel_one_row = [], [], [], [], []
        layer_kernel_calls, onednn_rows = [], []
        for e, wide in ((plain, None), (mkl, None), (fast, None), (fast, VOCAB), (mkl, VOCAB), (layers, None),
                        (native, None)):
            # wide: the head counts as wide (models/cpu_gemm.py), so 1-32 rows read its [out, in] tensor
            cpu_gemm.OUT_MAJOR_MIN_OUT, default_wide = wide or cpu_gemm.OUT_MAJOR_MIN_OUT, cpu_gemm.OUT_MAJOR_MIN_OUT
            kernel_calls[:] = [0, 0, 0]
            try:
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
                    runs.append((e.generate(prompts, greedy, seed=0), e.generate(prompts, sampled, seed=4)))
                counted = list(kernel_calls)
                e.generate(prompts[1:2], greedy, seed=0)  # one row: every decode step's head runs 1 row
                one_row_calls, kernel_calls[:] = kernel_calls[1] - counted[1], counted
            finally:
                cpu_gemm.OUT_MAJOR_MIN_OUT = default_wide
            head_kernel_calls.append(kernel_calls[0])
            head_kernel_one_row.append(one_row_calls)
            layer_kernel_calls.append(kernel_calls[2])
            events = prof.key_averages(group_by_input_shape=True)
            onednn_calls.append(sum(ev.count for ev in events if ev.key == "mkldnn::_linear_pointwise"))
            onednn_rows.append(sorted({ev.input_shapes[0][0] for ev in events
                                       if ev.key == "mkldnn::_linear_pointwise" and ev.input_shapes}))
            head_mkl_calls.append(sum(ev.count for ev in events if ev.key == "aten::mm" and ev.input_shapes
                                      and len(ev.input_shapes[0]) == 2 and ev.input_shapes[0][0] >= VOCAB
                                      and ev.input_shapes[0][1] == mc.hidden_size))
        out[tied] = dict(linears=len(linears), routed=routed, routed_inside=routed_inside, routed_after=routed_after,
                         routed_no_onednn=routed_no_onednn, routed_layer_kernel=routed_layer_kernel,
                         onednn_calls=onednn_calls, head_mkl_calls=head_mkl_calls,
                         head_kernel_calls=head_kernel_calls, head_kernel_one_row=head_kernel_one_row,
                         layer_kernel_calls=layer_kernel_calls, onednn_rows=onednn_rows,
                         kernel=kernel is not None, avx512="avx512f" in cpu_gemm._cpuinfo()[1], native_layers=[r[0].stats["native_layers"] for r in runs],
                         storages=len({w.untyped_storage().data_ptr() for w in weights}),
                         names=sorted(names[id(w)] for w in weights), switched=len(out_major), inside=inside,
                         restored=was_restored, restored_after_error=restored_after_error,
                         greedy=[r[0].responses() for r in runs], sampled=[r[1].responses() for r in runs],
                         logprob_diff=max(float((a.logprobs - b.logprobs).abs().max())
                                          for other in runs[1:] for a, b in zip(runs[0], other)))
    bf16 = Role("b", ModelConfig(num_layers=1, hidden_size=32, ffn_hidden_size=48, num_attention_heads=2,
                                 vocab_size=VOCAB, max_position_embeddings=16), ParallelConfig(), precision="bf16")
    out["bf16_switchable"] = len(decode_layout.switchable_weights(bf16.chunks))
    teardown()
    return out


@pytest.fixture(scope="module")
def result():
    return run_distributed(_body, 1)[0]


@pytest.mark.parametrize("tied", [False, True])
def test_every_linear_switches_and_comes_back_untouched(result, tied):
    r = result[tied]
    per_layer = ["self_attention.linear_qkv.weight", "self_attention.linear_proj.weight", "mlp.linear_fc1.weight",
                 "mlp.linear_fc2.weight"]
    head = "embedding.word_embeddings.weight" if tied else "output_layer.weight"
    assert r["names"] == sorted([f"decoder.layers.{i}.{n}" for i in range(2) for n in per_layer] + [head])
    assert r["switched"] == len(r["names"]) == len(r["inside"])
    assert all(in_major and moved and same and kept for in_major, moved, same, kept in r["inside"]), r["inside"]
    assert r["restored"] and r["restored_after_error"]
    assert r["storages"] == (1 if tied else len(r["names"]))  # one buffer / a tensor each


@pytest.mark.parametrize("tied", [False, True])
def test_generation_is_the_same_model_in_either_layout_and_library(result, tied):
    r = result[tied]
    assert all(g == r["greedy"][0] for g in r["greedy"]) and len(r["greedy"]) == 7
    assert all(s == r["sampled"][0] for s in r["sampled"])  # keyed draws, fp32 rounding
    assert 0.0 <= r["logprob_diff"] < 1e-4, r["logprob_diff"]


@pytest.mark.parametrize("tied", [False, True])
def test_every_linear_is_routed_to_onednn_and_comes_back(result, tied):
    r = result[tied]
    assert r["linears"] == 2 * 4 + 1  # qkv, proj, fc1, fc2 per layer and the LM head (tied: handed the embedding)
    assert r["routed"] == r["linears"] and r["routed_inside"] and r["routed_after"] == 0
    # without oneDNN only the wide (or tied) weights are wrapped, and only where the kernel is built
    head = ["output_layer"] if tied else []
    expected = [head, sorted(["linear_fc1"] * 2 + head)]
    if not r["kernel"]:
        expected = [[], []]
    assert [names for _, names in r["routed_no_onednn"]] == expected
    assert all(n == len(names) for n, names in r["routed_no_onednn"])
    assert r["routed_layer_kernel"] == (r["linears"] if r["kernel"] else 0)
    plain, mkl, fast, wide, mkl_wide, layers, native = r["onednn_calls"]
    assert plain == mkl == mkl_wide == 0
    # every linear of every forward with 2+ rows: at most the prefill and 9 decode steps of each of
    # the 4-row greedy and 12-row sampled batches (rows left alone at the end go MKL's path)
    assert r["linears"] * 10 <= fast <= r["linears"] * 20, r["onednn_calls"]
    # a wide head: its forwards of 2-32 rows leave oneDNN for the [out, in] tensor: megarl._cpu's
    # kernel where it runs, else MKL at 2-4 rows; at 1 row (never oneDNN's) the kernel where it runs
    # with AVX-512 (its AVX2 form leaves 1 row to MKL's matrix-vector product)
    mkl_calls, kernel_calls, one_row = r["head_mkl_calls"], r["head_kernel_calls"], r["head_kernel_one_row"]
    assert mkl_calls[2] == 0 and kernel_calls[:3] == [0, 0, 0] and one_row[:3] == [0, 0, 0], (mkl_calls, kernel_calls)
    assert (one_row[3] > 0) == (r["kernel"] and r["avx512"]) and one_row[4] == one_row[3], one_row
    assert (kernel_calls[3] > 0) == r["kernel"] and mkl_calls[3] + kernel_calls[3] > 0, (mkl_calls, kernel_calls)
    if r["kernel"]:
        assert mkl_calls[3] == 0, mkl_calls
    assert wide == fast - mkl_calls[3] - kernel_calls[3], r["onednn_calls"]
    # without oneDNN (the default on an Intel CPU) the wide head still runs the kernel, and only it
    assert kernel_calls[4] == kernel_calls[3] and mkl_calls[4] == 0, (mkl_calls, kernel_calls)
    # layer_kernel off: no other weight took the kernel
    assert r["layer_kernel_calls"][:5] == [0] * 5, r["layer_kernel_calls"]
    # layer_kernel (the default on an AMD CPU): every linear (the narrow head included) at 1-64 rows
    # runs the kernel where built, and every forward here has at most 44 rows (the prefill: 4 prompts
    # x 11 positions), all of which oneDNN ran without it
    assert r["onednn_rows"][2] and max(r["onednn_rows"][2]) <= 44, r["onednn_rows"]
    if r["kernel"]:
        assert r["layer_kernel_calls"][5] > 0 and layers == 0, (r["layer_kernel_calls"], r["onednn_rows"])
    else:
        assert r["layer_kernel_calls"][5] == 0 and layers == fast, r["onednn_calls"]
    # native layers (the default with layer_kernel): every decode step's layers run in one call of
    # megarl._cpu.decode_layer, whose GEMMs do not come back to Python; the prefills' still do
    assert r["native_layers"] == [False] * 6 + [r["kernel"]], r["native_layers"]
    if r["kernel"]:
        assert 0 < r["layer_kernel_calls"][6] < r["layer_kernel_calls"][5] and native == 0, r["layer_kernel_calls"]
    else:
        assert r["layer_kernel_calls"][6] == 0 and native == fast, r["onednn_calls"]


def test_bf16_weights_stay_in_their_layout(result):
    assert result["bf16_switchable"] == 0

