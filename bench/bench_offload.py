"""Offload/onload bandwidth of a role vs a plain `tensor.copy_` of the same bytes.

    python bench/bench_offload.py [--hidden 512 --layers 6 --vocab 8192] [--reps 5] [--threads N]
                                  [--malloc retain|default] [--cuda]

CPU (default): a real Role (fp32, Adam state materialised by one training step: params, grads,
optimizer state, a few hundred MB) is offloaded and onloaded; the baseline copies the same total
bytes with one `copy_` into a preallocated buffer, and (fair to what a move must do) with the
source freed after copying out / fresh memory allocated before copying in. Runs are interleaved
(all six per repetition), best and median reported, in GB/s (1e9 bytes/s).
Onload must allocate the freed memory again (`resize_`); with glibc's defaults large blocks come
back as fresh pages (a first-touch fault per 4 KiB) -- --malloc retain (the default) re-runs with
glibc told to keep freed memory, as the jemalloc/tcmalloc that training jobs preload do;
--malloc default shows the other figure. --threads 1 (the default): on a shared 2-core machine an
OpenMP wake-up per copy (ms under load) dominates the ~150 small storages; same threads for all.
--cuda (gpu): the same storage path on a CUDA module of the same sizes (params only, no
megatron-core needed): D2H offload into pinned buffers on the side stream and H2D onload, vs a
plain pinned `copy_` of the same bytes. Prints a markdown table.
"""
import argparse
import os
import statistics
import sys
import time

import torch


class _BareRole:
    """What offload needs from a role (name, chunks, optimizer): a plain module, for --cuda."""

    def __init__(self, module):
        self.name, self.chunks, self.optimizer = "bench", [module], None


def _cpu_role(args):
    from megarl.config import ModelConfig, OptimConfig, ParallelConfig
    from megarl.roles.role import Role
    from megarl.runtime.distributed import init_distributed

    init_distributed(1, 1, seed=1)
    cfg = ModelConfig(num_layers=args.layers, hidden_size=args.hidden, ffn_hidden_size=args.hidden * 11 // 4,
                      num_attention_heads=8, vocab_size=args.vocab, max_position_embeddings=64)
    role = Role("bench", cfg, ParallelConfig(), optim=OptimConfig(lr=1e-4))
    tokens = torch.randint(0, args.vocab, (2, 17))
    mb = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "position_ids": torch.arange(16).expand(2, 16)}

    def loss(batch, logits):
        lp = torch.log_softmax(logits.float(), -1)[..., : args.vocab].gather(-1, batch["labels"].unsqueeze(-1))
        return -lp.sum(), torch.tensor(lp.numel()), {"loss": torch.stack([-lp.sum().detach(), torch.tensor(float(lp.numel()))])}

    role.train_step([mb], loss)  # Adam's moments exist from here on
    return role


def _cuda_role(args):
    layers = [torch.nn.Linear(args.hidden, args.hidden * 11 // 4) for _ in range(args.layers * 4)]
    module = torch.nn.Sequential(torch.nn.Embedding(args.vocab, args.hidden), *layers).cuda()
    return _BareRole(module)


def _sync(cuda):
    if cuda:
        torch.cuda.synchronize()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0: torch default)")
    ap.add_argument("--malloc", choices=["retain", "default"], default="retain")
    ap.add_argument("--cuda", action="store_true", help="gpu: D2H/H2D through pinned host buffers")
    args = ap.parse_args()
    if args.malloc == "retain" and "MALLOC_TRIM_THRESHOLD_" not in os.environ:
        env = dict(os.environ, MALLOC_TRIM_THRESHOLD_=str(1 << 34), MALLOC_MMAP_MAX_="0")
        os.execve(sys.executable, [sys.executable] + sys.argv, env)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.cuda and not torch.cuda.is_available():
        sys.exit("--cuda: no CUDA device here")

    from megarl.roles import offload

    role = _cuda_role(args) if args.cuda else _cpu_role(args)
    res = offload.residency(role)
    nbytes = sum(v["device"] for v in res.values())
    device = "cuda" if args.cuda else "cpu"
    plain_dev = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    plain_host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=args.cuda)
    cuda = args.cuda

    def timed(fn):
        _sync(cuda)
        t0 = time.perf_counter()
        fn()
        _sync(cuda)
        return time.perf_counter() - t0

    def copy_out_free():  # the same bytes out, then the source freed (what offload also does)
        src = [plain_dev.clone()]
        _sync(cuda)
        t0 = time.perf_counter()
        plain_host.copy_(src[0], non_blocking=cuda)
        _sync(cuda)
        src.clear()
        _sync(cuda)
        return time.perf_counter() - t0

    def alloc_copy_in():  # fresh memory, then the bytes in (what onload also does)
        torch.empty(nbytes, dtype=torch.uint8, device=device).copy_(plain_host, non_blocking=cuda)

    times = {k: [] for k in ("offload", "onload", "copy out", "copy in", "copy out+free", "alloc+copy in")}
    for rep in range(args.reps + 1):  # the first round warms the host buffer pool and pages
        t = {"offload": timed(lambda: offload.offload(role)),
             "onload": timed(lambda: offload.onload(role)),
             "copy out": timed(lambda: plain_host.copy_(plain_dev, non_blocking=cuda)),
             "copy in": timed(lambda: plain_dev.copy_(plain_host, non_blocking=cuda)),
             "copy out+free": copy_out_free(),
             "alloc+copy in": timed(alloc_copy_in)}
        if rep:
            for k, v in t.items():
                times[k].append(v)
    gbs = {k: (nbytes / min(v) / 1e9, nbytes / statistics.median(v) / 1e9) for k, v in times.items()}
    kinds = ", ".join(f"{k} {v['device'] / 1e6:.0f} MB" for k, v in res.items())
    n_storages = sum(len(s) for s in offload.role_storages(role).values())
    print(f"{'cuda' if cuda else 'cpu'}: {nbytes / 1e6:.0f} MB in {n_storages} storages "
          f"({kinds}), "
          f"threads={torch.get_num_threads()}, malloc={args.malloc}, reps={args.reps}\n")
    print("| move | best GB/s | median GB/s | best / plain copy_ | best / copy_ with free/alloc |")
    print("|---|---|---|---|---|")
    for move, plain, fair in (("offload", "copy out", "copy out+free"), ("onload", "copy in", "alloc+copy in")):
        print(f"| {move} | {gbs[move][0]:.2f} | {gbs[move][1]:.2f} | {gbs[move][0] / gbs[plain][0]:.0%} "
              f"| {gbs[move][0] / gbs[fair][0]:.0%} |")
    for k in ("copy out", "copy in", "copy out+free", "alloc+copy in"):
        print(f"| plain {k} | {gbs[k][0]:.2f} | {gbs[k][1]:.2f} | | |")


if __name__ == "__main__":
    main()
