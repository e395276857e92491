"""Every collective of the per-rank API once, with small tensors you can read.

broadcast, reduce, all_gather, reduce_scatter, send/recv and all_to_all, one
process per GPU.  Run: python examples/02_collectives.py
"""
import os
import sys

import torch
import torch.multiprocessing as mp

import pyccl


def worker(rank, world, uid):
    pyccl.place_rank(rank, world)  # GPU rank % GPUs; RANKS above the GPU count share them
    comm = pyccl.Communicator(world, uid, rank)
    dev = "cuda"

    def show(name, t):
        torch.cuda.synchronize()
        print(f"[rank {rank}] {name:<15} {t.tolist()}", flush=True)
        return t.cpu()

    x = torch.tensor([rank + 1.0, 10.0 * (rank + 1)], device=dev)

    b = x.clone()
    comm.broadcast(b, root=world - 1)
    assert torch.equal(show("broadcast", b), torch.tensor([world, 10.0 * world]))

    r = x.clone()
    comm.reduce(r, root=0, op=pyccl.MAX)
    got = show("reduce(max)", r)
    if rank == 0:
        assert torch.equal(got, torch.tensor([world, 10.0 * world]))

    g = torch.zeros(2 * world, device=dev)
    comm.all_gather(x, g)
    assert torch.equal(show("all_gather", g),
                       torch.tensor([v for k in range(world) for v in (k + 1.0, 10.0 * (k + 1))]))

    big = torch.arange(2 * world, dtype=torch.float32, device=dev) * (rank + 1)
    rs = torch.zeros(2, device=dev)
    comm.reduce_scatter(big, rs)
    total = sum(range(1, world + 1))
    assert torch.equal(show("reduce_scatter", rs), torch.tensor([2.0 * rank, 2.0 * rank + 1]) * total)

    got = torch.zeros(2, device=dev)
    with pyccl.group():  # a ring: send right, receive from the left, together
        comm.send(x, (rank + 1) % world)
        comm.recv(got, (rank - 1) % world)
    left = (rank - 1) % world
    assert torch.equal(show("send/recv", got), torch.tensor([left + 1.0, 10.0 * (left + 1)]))

    a2a_in = torch.tensor([100.0 * rank + k for k in range(world)], device=dev)
    a2a_out = torch.zeros(world, device=dev)
    comm.all_to_all(a2a_in, a2a_out)
    assert torch.equal(show("all_to_all", a2a_out), torch.tensor([100.0 * k + rank for k in range(world)]))
    comm.destroy()


def main():
    gpus = torch.cuda.device_count()
    if gpus == 0:
        sys.exit("02_collectives: no CUDA GPU found")
    world = int(os.environ.get("RANKS", gpus))  # RANKS=4 on one GPU: 4 ranks share it
    mp.spawn(worker, args=(world, pyccl.unique_id()), nprocs=world, join=True)
    print("OK")


if __name__ == "__main__":
    main()
