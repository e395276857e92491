"""A tensor-parallel MLP under torch.compile, its all-reduce through pyccl.

Megatron-style: the first Linear is split by output columns (each rank holds
hidden/world of them), the second by input rows; each rank's partial output is
summed over the ranks by `pyccl.ops.all_reduce`, a torch custom op.  So
torch.compile(fullgraph=True) keeps the whole forward in one graph, and
mode="reduce-overhead" runs it as a CUDA graph, collective included.  The
compiled forward is checked bitwise against eager, and against the unsplit MLP
on one GPU (to float32 rounding: the sum's order differs).
One process per GPU (mp.spawn; RANKS=N for N ranks, sharing GPUs where N is larger).
Run: python examples/08_compile_tp.py
"""
import datetime
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import pyccl  # registers backend "pyccl" and torch.ops.pyccl.*


class TPMLP(nn.Module):
    """This rank's shard of `full` (Linear -> ReLU -> Linear), the output summed over `group`."""

    def __init__(self, full, rank, world, group):
        super().__init__()
        up, down = full[0], full[2]
        shard = up.out_features // world
        rows = slice(rank * shard, (rank + 1) * shard)
        # biases added apart from the matrix products (no fused addmm), so that eager and
        # compiled code run the same cuBLAS products and can be compared bitwise
        self.up = nn.Linear(up.in_features, shard, bias=False).cuda()
        self.down = nn.Linear(shard, down.out_features, bias=False).cuda()
        with torch.no_grad():
            self.up.weight.copy_(up.weight[rows])
            self.down.weight.copy_(down.weight[:, rows])
        self.up_bias = nn.Parameter(up.bias.detach()[rows].clone())
        self.down_bias = nn.Parameter(down.bias.detach().clone())  # added once, after the sum
        self.group = group

    def forward(self, x):
        partial = self.down(torch.relu(self.up(x) + self.up_bias))
        return pyccl.ops.all_reduce(partial, self.group) + self.down_bias


def time_ms(fn, x, n=50):
    for _ in range(3):
        fn(x)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn(x)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e3


def worker(rank, world, rendezvous):
    pyccl.place_rank(rank, world)  # GPU rank % GPUs; RANKS above the GPU count share them
    dist.init_process_group("pyccl", init_method=f"file://{rendezvous}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    torch.manual_seed(0)  # the same full MLP on every rank; each keeps its shard
    dim, hidden = 1024, 4096
    full = nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, dim)).cuda()
    tp = TPMLP(full, rank, world, dist.group.WORLD)
    compiled = torch.compile(tp, fullgraph=True, mode="reduce-overhead")
    worst = 0.0
    with torch.no_grad():
        for step in range(8):
            x = torch.randn(64, dim, device="cuda", generator=torch.Generator("cuda").manual_seed(step))
            eager = tp(x)
            got = compiled(x).clone()  # (a CUDA graph's output is overwritten by its next replay)
            assert torch.equal(got, eager), \
                f"step {step}: compiled differs from eager by up to {(got - eager).abs().max().item():.3e}"
            ref = full(x)
            worst = max(worst, ((got - ref).abs().max() / ref.abs().max()).item())
        assert worst < 1e-5, worst
        eager_ms, compiled_ms = time_ms(tp, x), time_ms(compiled, x)
    if rank == 0:
        print(f"forward of a 64x{dim} batch: eager {eager_ms:.3f} ms, compiled (CUDA graph) {compiled_ms:.3f} ms; "
              f"largest difference from the unsplit MLP {worst:.1e} of its largest output", flush=True)
    dist.destroy_process_group()


def main():
    gpus = torch.cuda.device_count()
    if gpus == 0:
        sys.exit("08_compile_tp: no CUDA GPU found")
    world = int(os.environ.get("RANKS", gpus))  # RANKS=4 on one GPU: 4 ranks share it
    if 4096 % world:
        sys.exit(f"08_compile_tp: the hidden size 4096 does not split over {world} ranks")
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(world, os.path.join(tmp, "rendezvous")), nprocs=world, join=True)
    print(f"OK: tensor-parallel MLP over {world} rank(s) with pyccl.ops.all_reduce, compiled "
          "(fullgraph, CUDA graphs) bitwise equal to eager")


if __name__ == "__main__":
    main()
