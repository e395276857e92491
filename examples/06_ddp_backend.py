"""DistributedDataParallel on the torch.distributed backend "pyccl".

`import pyccl` registers the backend; after that the only change to a DDP script
is `backend="pyccl"` in init_process_group.  One process per GPU (mp.spawn; RANKS=N
for N ranks, sharing GPUs where N is larger), a small MLP on each rank's shard of a synthetic regression
task.  The loss goes down and the replicas stay bitwise identical (checked with
an all_gather of a checksum of the parameters' bits).
Run: python examples/06_ddp_backend.py   (STEPS=... to change the 200 steps)
"""
import datetime
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

import pyccl  # registers backend "pyccl"


def worker(rank, world, rendezvous, steps):
    pyccl.place_rank(rank, world)  # GPU rank % GPUs; RANKS above the GPU count share them
    dist.init_process_group("pyccl", init_method=f"file://{rendezvous}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))  # a dead peer raises after 120 s
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(),
                                torch.nn.Linear(512, 512), torch.nn.ReLU(),
                                torch.nn.Linear(512, 1)).cuda()
    model = DDP(model, device_ids=[torch.cuda.current_device()])
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator(device="cuda").manual_seed(1234 + rank)  # this rank's shard
    w_true = torch.linspace(-1, 1, 64, device="cuda")
    losses = []
    for step in range(steps):
        x = torch.randn(128, 64, device="cuda", generator=g)
        y = (x @ w_true).unsqueeze(1) + 0.1 * torch.sin(3 * x[:, :1])
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()  # DDP all-reduces the gradient buckets through pyccl
        opt.step()
        avg = loss.detach().clone()
        dist.all_reduce(avg, op=dist.ReduceOp.AVG)
        losses.append(avg.item())
        if rank == 0 and (step % 50 == 0 or step == steps - 1):
            print(f"step {step:4d}  loss {losses[-1]:.5f}", flush=True)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    mine = flat.view(torch.int32).to(torch.int64).sum().reshape(1)
    sums = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(sums, mine)
    assert len({s.item() for s in sums}) == 1, f"replicas diverged: {[s.item() for s in sums]}"
    assert losses[-1] < 0.2 * losses[0], (losses[0], losses[-1])
    dist.destroy_process_group()


def main():
    gpus = torch.cuda.device_count()
    if gpus == 0:
        sys.exit("06_ddp_backend: no CUDA GPU found")
    world = int(os.environ.get("RANKS", gpus))  # RANKS=4 on one GPU: 4 ranks share it
    steps = int(os.environ.get("STEPS", "200"))
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(world, os.path.join(tmp, "rendezvous"), steps), nprocs=world, join=True)
    print(f"OK: DDP over {world} rank(s) on backend pyccl, replicas identical")


if __name__ == "__main__":
    main()
