"""One rank of test_init_from_mpi (run under mpirun)."""
import torch

import pyccl

comm = pyccl.init_from_mpi()
t = torch.full((999,), float(comm.rank + 1), device=f"cuda:{comm.device}")
comm.all_reduce(t)
torch.cuda.synchronize()
assert torch.equal(t.cpu(), torch.full((999,), float(comm.size * (comm.size + 1) // 2)))
print(f"mpi rank {comm.rank} ok", flush=True)
comm.destroy()
