"""Gradient accumulation, bf16 gradients, sub-communicators and group calls.

- accumulate gradients over several micro-batches, all-reduce once;
- bf16 gradients all-reduced with premul_sum(1/world) (an average in one op);
- comm.split(): ranks of even and odd index get their own communicators;
- pyccl.group(): several collectives launched as one NCCL group.
Run: python examples/05_advanced.py
"""
import os
import sys

import torch
import torch.multiprocessing as mp

import pyccl


def worker(rank, world, uid):
    pyccl.place_rank(rank, world)  # GPU rank % GPUs; RANKS above the GPU count share them
    comm = pyccl.Communicator(world, uid, rank)

    # 1. gradient accumulation: 4 micro-batches, one all-reduce
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 8).cuda()
    g = torch.Generator(device="cuda").manual_seed(rank)
    for _ in range(4):
        x = torch.randn(16, 32, device="cuda", generator=g)
        (model(x).square().mean() / 4).backward()
    for p in model.parameters():
        comm.all_reduce(p.grad, op=pyccl.AVG)
    checksum = torch.zeros(world, device="cuda")
    comm.all_gather(model.weight.grad.sum().reshape(1), checksum)
    assert len(set(checksum.tolist())) == 1
    print(f"[rank {rank}] accumulated grads averaged, checksum {checksum[0].item():.6f}", flush=True)

    # 2. bf16 gradients, averaged by premul_sum(1/world) (exact for these values)
    grad = torch.full((1024,), 2.0 * (rank + 1), dtype=torch.bfloat16, device="cuda")
    comm.all_reduce(grad, op=pyccl.premul_sum(1.0 / world))
    want = 2.0 * sum(range(1, world + 1)) / world
    torch.cuda.synchronize()
    assert torch.all(grad.float() == want), grad[:4]
    print(f"[rank {rank}] bf16 premul_sum average = {grad[0].item()}", flush=True)

    # 3. sub-communicators: even and odd ranks
    sub = comm.split(color=rank % 2)
    t = torch.tensor([float(rank)], device="cuda")
    sub.all_reduce(t)
    members = [r for r in range(world) if r % 2 == rank % 2]
    torch.cuda.synchronize()
    assert t.item() == sum(members)
    print(f"[rank {rank}] in sub-communicator {members}: sum of ranks = {t.item()}", flush=True)
    sub.destroy()

    # 4. group calls: two all-reduces and an all-gather launched together
    a = torch.ones(10, device="cuda") * rank
    b = torch.ones(20, device="cuda") * (rank + 1)
    c = torch.zeros(world, device="cuda")
    with pyccl.group():
        comm.all_reduce(a)
        comm.all_reduce(b, op=pyccl.MAX)
        comm.all_gather(torch.tensor([rank * 1.0], device="cuda"), c)
    torch.cuda.synchronize()
    assert a[0].item() == sum(range(world)) and b[0].item() == world
    assert c.tolist() == [float(r) for r in range(world)]
    print(f"[rank {rank}] grouped: {a[0].item()}, {b[0].item()}, {c.tolist()}", flush=True)
    comm.destroy()


def main():
    gpus = torch.cuda.device_count()
    if gpus == 0:
        sys.exit("05_advanced: no CUDA GPU found")
    world = int(os.environ.get("RANKS", gpus))  # RANKS=4 on one GPU: 4 ranks share it
    mp.spawn(worker, args=(world, pyccl.unique_id()), nprocs=world, join=True)
    print("OK")


if __name__ == "__main__":
    main()
