"""All-reduce under torchrun: torchrun --nproc_per_node=N examples/torchrun_all_reduce.py

pyccl.init_from_env() reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
MASTER_PORT and exchanges the NCCL unique id through torchrun's TCPStore.
Across nodes: torchrun --nnodes=2 --node_rank=K --master_addr=HOST ... (docs/guides/communicator.md).
More ranks than GPUs (developing on one GPU): PYCCL_SHARE_GPUS=1 torchrun --nproc_per_node=4 ...
"""

import torch

import pyccl

comm = pyccl.init_from_env(timeout=120)
t = torch.full((8,), float(comm.rank + 1), device=f"cuda:{comm.device}")
comm.all_reduce(t)
torch.cuda.synchronize()
want = comm.size * (comm.size + 1) / 2
assert torch.all(t == want), t
print(f"[rank {comm.rank}/{comm.size}] all_reduce -> {t[0].item()}", flush=True)
comm.barrier()
if comm.rank == 0:
    print("OK", flush=True)
comm.destroy()
