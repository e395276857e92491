"""All-reduce across every local GPU: one process per GPU, started by mp.spawn.

The parent makes the NCCL unique id and hands it to the children; each child
joins the communicator, shows its tensor before and after, and checks it.
Run: python examples/01_all_reduce.py
"""
import os
import sys

import torch
import torch.multiprocessing as mp

import pyccl


def worker(rank, world, uid):
    pyccl.place_rank(rank, world)  # GPU rank % GPUs; RANKS above the GPU count share them
    with pyccl.Communicator(world, uid, rank) as comm:
        t = torch.arange(4, dtype=torch.float32, device="cuda") + 10 * rank
        print(f"[rank {rank}] before: {t.tolist()}", flush=True)
        comm.all_reduce(t)
        torch.cuda.synchronize()
        print(f"[rank {rank}] after:  {t.tolist()}", flush=True)
        want = torch.arange(4, dtype=torch.float32) * world + 10 * sum(range(world))
        assert torch.equal(t.cpu(), want), (t, want)


def main():
    gpus = torch.cuda.device_count()
    if gpus == 0:
        sys.exit("01_all_reduce: no CUDA GPU found; this demo needs at least one GPU")
    world = int(os.environ.get("RANKS", gpus))  # RANKS=4 on one GPU: 4 ranks share it
    print(f"all_reduce over {world} rank(s) on {min(world, gpus)} GPU(s), NCCL {pyccl.nccl.version()}")
    mp.spawn(worker, args=(world, pyccl.unique_id()), nprocs=world, join=True)
    print("OK")


if __name__ == "__main__":
    main()
