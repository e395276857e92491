"""FSDP2 (fully_shard) on a DeviceMesh over the torch.distributed backend "pyccl".

`init_device_mesh("cuda", (world,))` builds its mesh on the default group, which
is pyccl's; FSDP2 all-gathers the parameters and reduce-scatters the gradients
through it.  The same training runs a second time on a "nccl" group of the same
processes, as the reference: the loss curves must agree to 1e-6 (relative).
One process per GPU (mp.spawn; RANKS=N for N ranks, sharing GPUs where N is larger).
Run: python examples/07_fsdp2.py   (STEPS=... to change the 30 steps)
"""
import copy
import datetime
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import pyccl  # registers backend "pyccl"

try:
    from torch.distributed.fsdp import fully_shard
except ImportError:  # torch < 2.6
    from torch.distributed._composable.fsdp import fully_shard


def train(model, mesh, steps, rank):
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator(device="cuda").manual_seed(1234 + rank)  # this rank's data
    losses = []
    for _ in range(steps):
        x = torch.randn(32, 256, device="cuda", generator=g)
        y = x[:, :16].sin()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()  # gradients reduce-scattered over the mesh
        opt.step()
        opt.zero_grad()
        avg = loss.detach().clone()
        dist.all_reduce(avg, op=dist.ReduceOp.SUM, group=mesh.get_group())
        losses.append(avg.item() / mesh.size())
    return losses


def worker(rank, world, rendezvous, steps):
    pyccl.place_rank(rank, world)  # GPU rank % GPUs; RANKS above the GPU count share them
    dist.init_process_group("pyccl", init_method=f"file://{rendezvous}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    mesh = init_device_mesh("cuda", (world,))  # on the default group: pyccl
    assert mesh.get_group().name() == "pyccl", mesh.get_group()
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 1024),
                               torch.nn.GELU(), torch.nn.Linear(1024, 16)).cuda()
    ours = train(copy.deepcopy(base), mesh, steps, rank)
    nccl_mesh = DeviceMesh.from_group(dist.new_group(backend="nccl"), "cuda")
    ref = train(copy.deepcopy(base), nccl_mesh, steps, rank)
    worst = max(abs(a - b) / abs(b) for a, b in zip(ours, ref))
    assert worst <= 1e-6, f"loss curves differ by {worst:.2e} (relative)"
    assert ours[-1] < 0.5 * ours[0], (ours[0], ours[-1])
    if rank == 0:
        print(f"loss {ours[0]:.5f} -> {ours[-1]:.5f} in {steps} steps; largest relative difference from "
              f"the same run on nccl: {worst:.1e}", flush=True)
    dist.destroy_process_group()


def main():
    gpus = torch.cuda.device_count()
    if gpus == 0:
        sys.exit("07_fsdp2: no CUDA GPU found")
    world = int(os.environ.get("RANKS", gpus))  # RANKS=4 on one GPU: 4 ranks share it
    steps = int(os.environ.get("STEPS", "30"))
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(world, os.path.join(tmp, "rendezvous"), steps), nprocs=world, join=True)
    print(f"OK: FSDP2 over {world} rank(s) on backend pyccl, the loss curve of nccl's")


if __name__ == "__main__":
    main()
