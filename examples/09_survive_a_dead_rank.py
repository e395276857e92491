"""The ranks left carry on after one dies: a timeout turns the dead peer into an exception,
shrink() makes a communicator of the survivors, and the loop goes on there.

4 ranks loop over all_reduces; rank 3 is killed with SIGKILL halfway.  The others raise
pyccl.NcclError within the timeout (plus a little), shrink the failed communicator to the
3 of them (renumbered 0..2), destroy the old one (its memory comes back), and finish the
loop, each result checked against a reference.  Which rank died is known here; in a real
job the launcher or your own heartbeat tells you.

Needs NCCL >= 2.28 (ncclCommRevoke keeps a failed communicator's handle for shrink()).
Run: python examples/09_survive_a_dead_rank.py      (4 ranks; RANKS=N for more)
"""
import os
import signal
import sys
import time

import torch
import torch.multiprocessing as mp

import pyccl

TIMEOUT = 5.0   # seconds a call may wait for its peers before the communicator fails
STEPS = 200
KILL_AT = 100


def worker(rank, world, uid, killed_at):
    pyccl.place_rank(rank, world)  # GPU rank % GPUs; more ranks than GPUs share them
    victim = world - 1
    comm = pyccl.Communicator(world, uid, rank, timeout=TIMEOUT)
    members = list(range(world))  # original ranks of the current communicator, in its order
    t = torch.empty(1 << 16, device="cuda")
    step = 0
    while step < STEPS:
        if rank == victim and step == KILL_AT:
            killed_at.value = time.time()
            os.kill(os.getpid(), signal.SIGKILL)
        t.fill_(rank + 1 + step % 5)
        try:
            comm.all_reduce(t)
            comm.wait()  # bounded by the timeout, unlike torch.cuda.synchronize()
        except pyccl.NcclError as e:
            took = time.time() - killed_at.value
            print(f"[rank {rank}] step {step}: {type(e).__name__} {took:.1f} s after the kill: {e}",
                  flush=True)
            new = comm.shrink(exclude=[members.index(victim)])
            comm.destroy()
            comm = new
            members.remove(victim)
            print(f"[rank {rank}] now rank {comm.rank} of {comm.size}", flush=True)
            continue  # this step again, on the ranks left
        want = float(sum(m + 1 + step % 5 for m in members))
        assert torch.equal(t, torch.full_like(t, want)), (step, t[:4], want)
        step += 1
    print(f"[rank {rank}] finished {STEPS} steps on {comm.size} ranks", flush=True)
    comm.destroy()


def main():
    if torch.cuda.device_count() == 0:
        sys.exit("09_survive_a_dead_rank: no CUDA GPU found")
    world = max(4, int(os.environ.get("RANKS", 4)))
    ctx = mp.get_context("spawn")
    killed_at = ctx.Value("d", 0.0)
    uid = pyccl.unique_id()
    procs = [ctx.Process(target=worker, args=(r, world, uid, killed_at)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
    codes = [p.exitcode for p in procs]
    if codes[:-1] != [0] * (world - 1) or codes[-1] != -signal.SIGKILL:
        sys.exit(f"09_survive_a_dead_rank: exit codes {codes}")
    print("OK")


if __name__ == "__main__":
    main()
