"""Data-parallel training with pyccl: sharded data, bucketed gradient all-reduce.

Each process trains the same small MLP on its own shard of a synthetic
regression task; after backward, gradients are packed into ~1 MB buckets and
averaged with one all_reduce per bucket.  The loss goes down, and the replicas
stay bitwise identical (checked every few steps with an all_gather of a
parameter checksum).  Run: python examples/03_ddp_training.py
"""
import os
import sys

import torch
import torch.multiprocessing as mp

import pyccl

BUCKET_BYTES = 1 << 20


def buckets(params):
    """Group parameters (in reverse, the order backward produces them) by size."""
    out, cur, size = [], [], 0
    for p in reversed(params):
        cur.append(p)
        size += p.numel() * p.element_size()
        if size >= BUCKET_BYTES:
            out.append(cur)
            cur, size = [], 0
    if cur:
        out.append(cur)
    return out


def average_gradients(comm, groups):
    for group in groups:
        flat = torch.cat([p.grad.reshape(-1) for p in group])
        comm.all_reduce(flat, op=pyccl.AVG)
        offset = 0
        for p in group:
            n = p.numel()
            p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
            offset += n


def worker(rank, world, uid, steps):
    pyccl.place_rank(rank, world)  # GPU rank % GPUs; RANKS above the GPU count share them
    comm = pyccl.Communicator(world, uid, rank)
    torch.manual_seed(0)  # same initial weights everywhere
    model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(),
                                torch.nn.Linear(512, 512), torch.nn.ReLU(),
                                torch.nn.Linear(512, 1)).cuda()
    for p in model.parameters():  # make sure: broadcast rank 0's weights
        comm.broadcast(p.data, root=0)
    groups = buckets(list(model.parameters()))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator(device="cuda").manual_seed(1234 + rank)  # this rank's shard
    w_true = torch.linspace(-1, 1, 64, device="cuda")
    losses = []
    for step in range(steps):
        x = torch.randn(128, 64, device="cuda", generator=g)
        y = (x @ w_true).unsqueeze(1) + 0.1 * torch.sin(3 * x[:, :1])
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        average_gradients(comm, groups)
        opt.step()
        avg = loss.detach().clone()
        comm.all_reduce(avg, op=pyccl.AVG)
        losses.append(avg.item())
        if step % 50 == 0 or step == steps - 1:
            flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            sums = torch.zeros(world, dtype=torch.int64, device="cuda")
            # an exact checksum of the bits of every parameter
            mine = flat.view(torch.int32).to(torch.int64).sum().reshape(1)
            comm.all_gather(mine, sums)
            assert len(set(sums.tolist())) == 1, f"replicas diverged at step {step}: {sums.tolist()}"
            if rank == 0:
                print(f"step {step:4d}  loss {losses[-1]:.5f}  replicas identical", flush=True)
    assert losses[-1] < 0.2 * losses[0], (losses[0], losses[-1])
    comm.destroy()


def main():
    gpus = torch.cuda.device_count()
    if gpus == 0:
        sys.exit("03_ddp_training: no CUDA GPU found")
    world = int(os.environ.get("RANKS", gpus))  # RANKS=4 on one GPU: 4 ranks share it
    steps = int(os.environ.get("STEPS", "300"))
    mp.spawn(worker, args=(world, pyccl.unique_id(), steps), nprocs=world, join=True)
    print("OK")


if __name__ == "__main__":
    main()
