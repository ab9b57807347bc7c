"""The graph-safe decode step (megarl/rollout/decode.py) and the engine's static path.

Contract, checked on CPU where no CUDA graph exists:
- the steady-state step, at TP 1 and 2, runs under tests/host_sync_guard.py (no host read,
  data-dependent shape, host-made tensor or device wait, seen as Python calls and as aten ops)
  and keeps the storage of every input, output and KV-cache tensor from one step to the next;
- a recorder standing in for capture checks that each replay reads the memory its capture read
  (what a real replay reads), across calls, weight updates and RoPE-cache evictions;
- the engine's static path gives the per-step path's tokens: greedy and sampled (same seed),
  with log-probs within fp32 rounding, at TP1 here and TP2 in two processes; whatever
  sync_every, bucket compaction on or off; MoE too (uncaptured: its dispatch reads the host).
The graphs themselves (capture, replay, graphs on vs off, TP 2) are `gpu`-marked below.
"""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dist_helpers import run_distributed
from test_rollout import PAD, VOCAB, _model_cfg, _prompts  # the rollout tests' tiny model and mixed-length prompts

def _stop_ids(role):
    """Two ids the greedy rollout emits at different steps, so rows stop at different times."""
    from megarl.rollout.engine import MegatronRolloutEngine, SamplingParams

    eng = MegatronRolloutEngine(role, vocab_size=VOCAB, pad_id=PAD, static_decode=False)
    r = eng.generate(_prompts(), SamplingParams(greedy=True, max_new_tokens=12), seed=0)
    resp = r.responses()
    return (resp[0][3], resp[4][7])


def _compare_body(rank, world_size, tp):
    from megarl.config import ParallelConfig
    from megarl.roles.role import Role
    from megarl.rollout.engine import MegatronRolloutEngine, SamplingParams
    from megarl.runtime.distributed import init_distributed, teardown

    init_distributed(tp, 1, seed=11)
    role = Role("actor", _model_cfg(), ParallelConfig(tp=tp), head="lm", seed=5)
    prompts, stop_ids = _prompts(), _stop_ids(role)
    cases = [SamplingParams(greedy=True, max_new_tokens=14, stop_ids=stop_ids),
             SamplingParams(n=3, temperature=1.0, max_new_tokens=12, stop_ids=stop_ids),
             SamplingParams(n=2, temperature=0.8, top_k=12, top_p=0.9, max_new_tokens=10, stop_ids=stop_ids),
             SamplingParams(n=4, temperature=1.0, max_new_tokens=12, stop_ids=tuple(range(1, 16)))]  # rows end early
    out = []
    for params in cases:
        eager = MegatronRolloutEngine(role, vocab_size=VOCAB, pad_id=PAD, max_batch_size=16, static_decode=False)
        ref = eager.generate(prompts, params, seed=7)
        for sync_every, compact in ((1, True), (3, True), (8, False)):
            eng = MegatronRolloutEngine(role, vocab_size=VOCAB, pad_id=PAD, max_batch_size=16, static_decode=True,
                                        sync_every=sync_every, compact=compact)
            got = eng.generate(prompts, params, seed=7)
            out.append(dict(params=params, sync_every=sync_every, ref=ref, got=got))
    teardown()
    return out


def _check(results):
    compacted = 0
    for case in results:
        ref, got = case["ref"], case["got"]
        assert got.stats.get("static_decode"), "the static path did not run"
        compacted += got.stats["compactions"]
        assert ref.responses() == got.responses(), (case["params"], case["sync_every"])
        assert torch.equal(ref.stopped, got.stopped) and torch.equal(ref.response_mask, got.response_mask)
        torch.testing.assert_close(got.logprobs, ref.logprobs, rtol=0, atol=2e-5)
        assert got.stats["host_syncs"] < got.stats["forwards"] or case["sync_every"] == 1
    assert compacted > 0, "no case moved its rows into a smaller bucket"


def test_static_path_gives_the_per_step_paths_tokens():
    _check(run_distributed(_compare_body, 1, 1)[0])


@pytest.mark.slow
def test_static_path_gives_the_per_step_paths_tokens_at_tp2():
    results = run_distributed(_compare_body, 2, 2)
    for r in results:
        _check(r)
    assert [c["got"].responses() for c in results[0]] == [c["got"].responses() for c in results[1]]


def _contract_body(rank, world_size, tp=1):
    from host_sync_guard import HostSyncGuard

    from megarl.config import ParallelConfig
    from megarl.roles.role import Role
    from megarl.rollout import engine as engine_mod
    from megarl.rollout.decode import decode_step
    from megarl.rollout.engine import MegatronRolloutEngine, SamplingParams
    from megarl.runtime.distributed import init_distributed, teardown

    init_distributed(tp, 1, seed=11)
    role = Role("actor", _model_cfg(), ParallelConfig(tp=tp), head="lm", seed=5)
    seen = {"steps": 0, "storages": None, "reads": [], "calls": 0}
    real = engine_mod.decode_step

    def guarded(model, ctx, st, params, **kw):
        tensors = [getattr(st, f) for f in ("tokens", "positions", "mask", "uniforms", "out_ids", "out_lp",
                                            "resp_len", "done", "stopped")]
        tensors += [c for kv in ctx.key_value_memory_dict.values() for c in kv]
        storages = [t.untyped_storage().data_ptr() for t in tensors]
        if seen["storages"] is not None and len(storages) == len(seen["storages"]) and \
                st.size == seen["size"]:  # the same bucket: the same memory
            assert storages == seen["storages"], "a decode step's tensors moved between steps"
        seen["storages"], seen["size"] = storages, st.size
        guard = HostSyncGuard(strict=False)
        with guard:
            real(model, ctx, st, params, **kw)
        seen["reads"] += guard.reads
        seen["calls"] += guard.calls
        seen["steps"] += 1

    engine_mod.decode_step = guarded
    try:
        eng = MegatronRolloutEngine(role, vocab_size=VOCAB, pad_id=PAD, max_batch_size=16, static_decode=True,
                                    sync_every=4, decode=_letters)
        for params in (SamplingParams(greedy=True, max_new_tokens=10),
                       SamplingParams(n=2, temperature=0.9, top_k=20, top_p=0.95, max_new_tokens=10,
                                      stop_ids=_stop_ids(role)),
                       # many stop ids (torch.isin would sort them) and a stop string (rows held)
                       SamplingParams(n=2, temperature=1.0, max_new_tokens=10, stop_ids=tuple(range(1, 40)),
                                      stop_strings=("qq",))):
            eng.generate(_prompts(), params, seed=3)
    finally:
        engine_mod.decode_step = real
    assert decode_step is real
    teardown()
    return seen


def _letters(ids) -> str:
    """A tokenizer's decode for the tiny vocabulary: one letter per id."""
    return "".join(chr(97 + i % 26) for i in ids)


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_decode_step_reads_nothing_on_the_host_and_keeps_its_storage(tp):
    """At TP 2 the step's forward also gathers the logits over TP (inside the graph on a GPU)."""
    for seen in run_distributed(_contract_body, tp, tp):
        assert seen["steps"] > 10
        assert seen["calls"] > 100 * seen["steps"], "the guard saw too few torch calls to vouch for the step"
        assert seen["reads"] == [], f"host reads inside the decode step: {sorted(set(seen['reads']))}"


def _workspace_body(rank, world_size):
    from megarl.config import ParallelConfig
    from megarl.roles import offload
    from megarl.roles.residency import ResidencyLedger
    from megarl.roles.role import Role
    from megarl.rollout.engine import MegatronRolloutEngine, SamplingParams
    from megarl.runtime.distributed import init_distributed, teardown

    init_distributed(1, 1, seed=11)
    role = Role("actor", _model_cfg(), ParallelConfig(), head="lm", seed=5)
    ledger = ResidencyLedger()
    offload.attach(role, ledger)
    eager = MegatronRolloutEngine(role, vocab_size=VOCAB, pad_id=PAD, max_batch_size=16, static_decode=False)
    eng = MegatronRolloutEngine(role, vocab_size=VOCAB, pad_id=PAD, max_batch_size=16, static_decode=True,
                                sync_every=3)
    offload.register_workspace(role, "decode", eng.workspace)  # as trainers/evaluate.rollout_engine does
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=12, stop_ids=_stop_ids(role))

    def memory():  # where each kept tensor lives
        ws = eng.workspace
        out = {("cache", layer): [c.data_ptr() for c in kv] for layer, kv in ws.cache.items()}
        for key, st in ws.states.items():
            out[("state", key)] = [getattr(st, f).data_ptr() for f in ("tokens", "positions", "mask", "uniforms",
                                                                        "out_ids", "out_lp", "done")]
        return out

    out = {"same": [], "kept": [], "ledger": []}
    g = torch.Generator().manual_seed(4)
    for call in range(3):
        before = memory()
        got = eng.generate(_prompts(), params, seed=call)
        offload.report_workspaces(role)  # as RLStage.generate does
        out["same"].append(got.responses() == eager.generate(_prompts(), params, seed=call).responses())
        after = memory()
        out["kept"].append(all(after[k] == v for k, v in before.items() if k in after) and
                           (call == 0 or set(before) <= set(after)))
        out["ledger"].append((ledger.workspaces.get("actor/decode"), eng.workspace.nbytes(),
                              got.stats.get("static_decode", False)))
        with torch.no_grad():  # an optimizer step: the weights change in place
            for p in role.chunks[0].parameters():
                p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 1e-2)
    # a call that needs more slots (a new cache), then one that needs fewer (the kept cache's)
    long_engine = MegatronRolloutEngine(role, vocab_size=VOCAB, pad_id=PAD, max_batch_size=16, static_decode=True,
                                        sync_every=3, max_seq_len=1024)
    eager_long = MegatronRolloutEngine(role, vocab_size=VOCAB, pad_id=PAD, max_batch_size=16, static_decode=False,
                                       max_seq_len=1024)
    longer = [p + torch.randint(1, VOCAB, (300,), generator=g).tolist() for p in _prompts()[:3]]
    out["slots"] = []
    for prompts in (longer, _prompts()):
        got = long_engine.generate(prompts, params, seed=5)
        out["slots"].append((long_engine.workspace.seq,
                             got.responses() == eager_long.generate(prompts, params, seed=5).responses()))
    offload.offload(role, params=True, grads=False, optimizer=False)
    out["after_offload"] = (len(eng.workspace.cache), len(eng.workspace.states), ledger.workspaces["actor/decode"])
    offload.onload(role)
    got = eng.generate(_prompts(), params, seed=9)
    out["after_onload"] = got.responses() == eager.generate(_prompts(), params, seed=9).responses()
    teardown()
    return out


def test_workspace_is_kept_across_calls_and_released_by_the_offload():
    """The static decode's cache and states keep their memory from one generate call to the next
    (what graphs captured in one RL step replay against in the next), with the weights updated in
    place between calls; the ledger counts them under actor/decode; offloading the actor's
    parameters releases them, and the next call rebuilds them."""
    out = run_distributed(_workspace_body, 1)[0]
    assert out["same"] == [True] * 3, "the static path's tokens differ from the per-step path's"
    assert out["kept"] == [True] * 3, "the workspace's tensors moved between calls"
    for counted, nbytes, static in out["ledger"]:
        assert static and counted == nbytes > 0
    assert out["slots"] == [(512, True), (512, True)]  # the shorter call ran in the kept 512 slots
    assert out["after_offload"] == (0, 0, 0)
    assert out["after_onload"]


def _moe_body(rank, world_size):
    from host_sync_guard import HostSyncGuard

    from megarl.config import ModelConfig, MoEConfig, ParallelConfig
    from megarl.roles.role import Role
    from megarl.rollout import engine as engine_mod
    from megarl.rollout.engine import MegatronRolloutEngine, SamplingParams, graph_blocker
    from megarl.runtime.distributed import init_distributed, teardown

    init_distributed(1, 1, seed=11)
    mc = ModelConfig(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_attention_heads=4, num_kv_heads=2,
                     vocab_size=VOCAB, max_position_embeddings=48, init_std=0.1,
                     moe=MoEConfig(num_experts=4, topk=2, expert_hidden=32))
    role = Role("actor", mc, ParallelConfig(), head="lm", seed=5)
    out = {"blocker": graph_blocker(role.model.config, role.model), "same": [], "reads": []}
    for params in (SamplingParams(greedy=True, max_new_tokens=10), SamplingParams(n=2, max_new_tokens=10)):
        ref = MegatronRolloutEngine(role, vocab_size=VOCAB, pad_id=PAD, static_decode=False).generate(
            _prompts(), params, seed=3)
        got = MegatronRolloutEngine(role, vocab_size=VOCAB, pad_id=PAD, static_decode=True, sync_every=3).generate(
            _prompts(), params, seed=3)
        out["same"].append(ref.responses() == got.responses() and bool(got.stats.get("static_decode")))
    real = engine_mod.decode_step

    def guarded(*args, **kw):
        guard = HostSyncGuard(strict=False)
        with guard:
            real(*args, **kw)
        out["reads"] += guard.reads

    engine_mod.decode_step = guarded
    try:
        MegatronRolloutEngine(role, vocab_size=VOCAB, pad_id=PAD, static_decode=True).generate(
            _prompts()[:4], SamplingParams(greedy=True, max_new_tokens=4), seed=3)
    finally:
        engine_mod.decode_step = real
    teardown()
    return out


def test_moe_takes_the_graph_safe_step_uncaptured():
    """A MoE model decodes through the graph-safe step with the per-step path's tokens, but is not
    captured: megatron-core's token dispatch reads the host in every forward (the guard sees it;
    should that change, graph_blocker can let MoE graphs in)."""
    out = run_distributed(_moe_body, 1)[0]
    assert out["same"] == [True, True]
    assert out["blocker"] and "MoE" in out["blocker"]
    assert any("tolist" in r or "masked_select" in r for r in out["reads"]), out["reads"]


def test_graph_blocker_names_models_a_graph_cannot_hold():
    from types import SimpleNamespace

    from megarl.rollout.engine import graph_blocker

    dense = SimpleNamespace(num_moe_experts=None, fp8=None)
    assert graph_blocker(dense, SimpleNamespace()) is None
    assert "MoE" in graph_blocker(SimpleNamespace(num_moe_experts=8, fp8=None), SimpleNamespace())
    fp8 = SimpleNamespace(num_moe_experts=None, fp8="e4m3")
    assert graph_blocker(fp8, SimpleNamespace(fp8_rollout="bf16")) is None  # generation in BF16 GEMMs
    assert "FP8" in graph_blocker(fp8, SimpleNamespace(fp8_rollout="fp8"))


class _ReadsRecorder(TorchDispatchMode):
    """The memory a step reads that existed before it (weights, KV cache, states, constants), as
    (storage, address, shape, strides, dtype) of every op's tensor inputs that no op of the step
    made; 0-dim tensors (scalars, passed by value) left out."""

    def __init__(self):
        super().__init__()
        self.reads, self.made = set(), set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        def tensors(tree):
            return [t for t in torch.utils._pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]

        for t in tensors((args, kwargs)):
            ptr = t.untyped_storage().data_ptr()
            if t.dim() and ptr not in self.made:
                self.reads.add((ptr, t.data_ptr(), tuple(t.shape), t.stride(), t.dtype))
        out = func(*args, **(kwargs or {}))
        seen = {r[0] for r in self.reads}
        self.made |= {t.untyped_storage().data_ptr() for t in tensors(out)} - seen
        return out


class _RecordedGraph:
    """Stands in for a captured CUDA graph on CPU: "capture" runs the two warm-up steps, the second
    recorded; each replay runs the current call's step and checks that it reads exactly the memory
    the capture read. That is what a real replay reads (the addresses baked in at capture), so a
    step that reads anything else there (a buffer made anew, a moved cache, a stale view) would
    compute on the wrong memory on a GPU."""

    def __init__(self, key, run, log):
        self.key, self.run, self.log = key, run, log
        run()
        self.reads = self._record()

    def _record(self):
        rec = _ReadsRecorder()
        with rec:
            self.run()
        return rec.reads

    def replay(self):
        reads = self._record()
        self.log.append((self.key[0], reads == self.reads))


def _replay_body(rank, world_size):
    import test_rollout_tools as tools_tests
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from megarl.config import ParallelConfig
    from megarl.data.tokenizer import ByteTokenizer
    from megarl.roles.role import Role
    from megarl.rollout.decode import DecodeWorkspace
    from megarl.rollout.engine import MegatronRolloutEngine, SamplingParams
    from megarl.runtime.distributed import init_distributed, teardown

    init_distributed(1, 1, seed=11)
    tok = ByteTokenizer()
    role = Role("actor", tools_tests._model_cfg(), ParallelConfig(), head="lm", seed=5)
    hook = tools_tests._bias_hook(role)  # arithmetic-looking text: tool calls and held rows
    log, captures = [], []

    def graph(ws, key, run):  # DecodeWorkspace.graph with the recorder in place of a capture
        if key in ws.graphs:
            ws.graphs[key].run = run  # this call's step: what a replay of the graph computes
            return ws.graphs[key], 0
        captures.append(key[0])
        ws.graphs[key] = _RecordedGraph(key, run, log)
        return ws.graphs[key], 2

    DecodeWorkspace.graph = graph
    MegatronRolloutEngine._can_capture = lambda self: True
    prompts = tools_tests._prompts()
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=24, stop_ids=tuple(tok.stop_ids),
                            stop_strings=("+1",))
    eng = tools_tests._engine(role, tools_tests._toolbox(max_calls=2), max_batch_size=24, static_decode=True,
                              sync_every=3)
    ref = tools_tests._engine(role, tools_tests._toolbox(max_calls=2), max_batch_size=24, static_decode=False)
    g = torch.Generator().manual_seed(4)
    out = {"same": []}
    for call in range(3):
        got = eng.generate(prompts, params, seed=call)
        want = ref.generate(prompts, params, seed=call)
        out["same"].append(got.responses() == want.responses() and torch.equal(got.sampled_mask, want.sampled_mask))
        with torch.no_grad():  # an optimizer step: the weights change in place
            for p in role.chunks[0].parameters():
                p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 1e-2)
        # training forwards of many lengths: megatron-core's RoPE cache (32 entries) lets go of
        # the table the rollout's last prefill used, whose memory may then be reused
        RotaryEmbedding.forward.cache_clear()
    out["calls"] = int(got.tool_calls.sum())
    hook.remove()
    teardown()
    return {**out, "log": log, "captures": captures}


def test_a_replayed_step_reads_the_memory_its_capture_read():
    """On CPU, with a recorder standing in for CUDA graph capture: over three generate calls with
    the weights updated in place and megatron-core's RoPE cache emptied between them, tool calls,
    held rows and rows moving into smaller buckets, every replay of a bucket's step reads the very
    tensors its capture read, and the tokens are the per-step path's."""
    out = run_distributed(_replay_body, 1)[0]
    assert out["same"] == [True] * 3
    assert out["calls"] > 0
    assert len(set(out["captures"])) >= 2, out["captures"]  # more than one bucket captured
    assert len(out["captures"]) == len(set(out["captures"])), "a bucket was captured twice"
    replayed = {size for size, _ in out["log"]}
    assert replayed == set(out["captures"]), (replayed, out["captures"])  # each bucket replayed
    assert all(same for _, same in out["log"]), [k for k, same in out["log"] if not same]


def test_guard_catches_each_kind_of_host_read():
    from host_sync_guard import HostSyncError, HostSyncGuard

    t = torch.arange(4.0)
    ids = torch.tensor([1, 2])
    for read in (lambda: t[0].item(), lambda: bool(t[0]), lambda: t.tolist(), lambda: t.cpu(),
                 lambda: torch.nonzero(t), lambda: t[t > 1], lambda: t.to("cpu"), lambda: int(t[1]),
                 lambda: torch.where(t > 1), lambda: torch.equal(t, t), lambda: torch.isin(ids, ids),
                 lambda: torch.arange(3), lambda: torch.tensor([1, 2], device=t.device), lambda: torch.unique(t),
                 lambda: t.clone().__setitem__(t > 1, 0.0), lambda: t.clone().index_put_((t > 1,), t[:1]),
                 lambda: torch.bincount(ids), lambda: torch.cuda.synchronize(), lambda: torch.cuda.get_rng_state()):
        with pytest.raises(HostSyncError):
            with HostSyncGuard():
                read()
    with HostSyncGuard():  # device-side work passes
        torch.where(t > 1, t, 0).argmax()
        mask = torch.zeros(8, dtype=torch.bool, device=t.device)
        t.index_select(0, ids).scatter_(0, ids[:1] - 1, t[:1]).add_(mask[ids].float())
        torch.arange(3, device=t.device)


def test_buckets():
    from megarl.rollout.decode import bucket_for, bucket_sizes

    assert bucket_sizes(64) == [64, 32, 16, 8] and bucket_sizes(100) == [100, 64, 32, 16, 8]
    assert bucket_sizes(12) == [12, 8] and bucket_sizes(8) == [8] and bucket_sizes(1) == [1]
    assert [bucket_for(n, bucket_sizes(64)) for n in (1, 8, 9, 33, 64)] == [8, 8, 16, 64, 64]


def test_uniform_table_is_row_uniforms_per_step():
    from megarl.rollout.sampling import row_uniforms, uniform_table

    ids = torch.tensor([0, 5, 17, 2**40])
    table = uniform_table(123, ids, range(6))
    for t in range(6):
        assert torch.equal(table[:, t], row_uniforms(123, ids, t))


# ------------------------------------------------------------------ on a GPU


def _gpu_roles(tp: int = 1, precision: str = "bf16"):
    from megarl.config import ModelConfig, ParallelConfig
    from megarl.roles.role import Role

    mc = ModelConfig(num_layers=4, hidden_size=256, ffn_hidden_size=512, num_attention_heads=8, num_kv_heads=4,
                     vocab_size=1000, max_position_embeddings=256, init_std=0.1)
    return Role("actor", mc, ParallelConfig(tp=tp), head="lm", precision=precision, seed=5)


_GPU_CASES = ({"greedy": True, "max_new_tokens": 64, "stop_ids": (7,)},
              {"n": 2, "temperature": 1.0, "top_p": 0.9, "max_new_tokens": 64, "stop_ids": (7,)},
              # many stop ids and a stop string: rows are held inside the captured step
              {"n": 2, "temperature": 1.0, "max_new_tokens": 64, "stop_ids": tuple(range(900, 960)),
               "stop_strings": ("qq",)})


def _graph_runs(role):
    """Each case's responses with the per-step path, the graph-safe step uncaptured and captured,
    and a second call of the graphs engine (its graphs kept): {case: {way: (responses, captured)}}."""
    from megarl.rollout.engine import MegatronRolloutEngine, SamplingParams

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 1000, (int(n),), generator=g).tolist() for n in torch.randint(3, 60, (24,))]
    out = {}
    for k, case in enumerate(_GPU_CASES):
        params, runs = SamplingParams(**case), {}
        for mode, kw in {"eager": dict(static_decode=False), "static": dict(static_decode=True, cuda_graphs=False),
                         "graphs": dict(static_decode=True, cuda_graphs=True)}.items():
            eng = MegatronRolloutEngine(role, vocab_size=1000, pad_id=0, max_batch_size=64, decode=_letters, **kw)
            r = eng.generate(prompts, params, seed=11)
            runs[mode] = (r.responses(), r.stats.get("cuda_graphs_captured", 0))
        r = eng.generate(prompts, params, seed=11)
        runs["again"] = (r.responses(), r.stats["cuda_graphs_captured"])
        out[k] = runs
    return out


def _check_graph_runs(out, precision):
    """Graphs on and off run the same kernels on the same shapes: the same tokens, bit for bit.
    The per-step path attends over fewer slots and groups rows otherwise, so against it greedy
    tokens are compared in fp32 (TF32 off), where such rounding cannot flip a greedy pick; in
    bf16 it can."""
    for k, runs in out.items():
        assert runs["graphs"][1] >= 1, "no graph was captured"
        assert runs["graphs"][0] == runs["static"][0], _GPU_CASES[k]
        assert runs["again"] == (runs["graphs"][0], 0), "the kept graphs were not replayed alike"
        if _GPU_CASES[k].get("greedy") and precision == "fp32":
            assert runs["static"][0] == runs["eager"][0], _GPU_CASES[k]


@pytest.mark.gpu
def test_cuda_graphs_on_and_off_give_the_same_tokens(monkeypatch):
    from megarl.runtime.distributed import init_distributed, teardown

    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    init_distributed(1, 1, seed=1)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        for precision in ("bf16", "fp32"):
            _check_graph_runs(_graph_runs(_gpu_roles(precision=precision)), precision)
    finally:
        teardown()


def _tp_graphs_body(rank, world_size):
    from megarl.runtime.distributed import init_distributed, teardown

    init_distributed(world_size, 1, seed=1)  # NCCL: the step's TP collectives are captured with it
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        return {precision: _graph_runs(_gpu_roles(tp=world_size, precision=precision)) for precision in ("bf16", "fp32")}
    finally:
        teardown()


@pytest.mark.gpu
def test_cuda_graphs_at_tp2_give_the_same_tokens():
    """The captured step at TP 2 holds the layers' all-reduces and the logits' all-gather."""
    if torch.cuda.device_count() < 2:
        pytest.skip("TP 2 needs two GPUs")
    results = run_distributed(_tp_graphs_body, 2, init_process_group=False)
    for out in results:
        for precision, runs in out.items():
            _check_graph_runs(runs, precision)
    assert results[0] == results[1], "the TP ranks generated different tokens"
