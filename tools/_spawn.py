"""One process per GPU for the measurement tools (fastar_sweep.py, eager_host.py): spawn them,
collect what each returns, and never hang on one that fails or falls silent."""
import queue
import sys
import traceback

import torch.multiprocessing as mp


def _child(target, rank, world, args, q):
    try:
        q.put((rank, "ok", target(rank, world, *args)))
    except BaseException:
        q.put((rank, "error", traceback.format_exc()))


def run_ranks(tool, target, world, *args, timeout=300):
    """target(rank, world, *args) in `world` spawned processes; returns {rank: its result}.
    Exits naming the rank that failed (with its traceback), or the ranks that gave no answer
    within `timeout` seconds; no process is left running."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(target, r, world, args, q)) for r in range(world)]
    for p in procs:
        p.start()
    got = {}
    try:
        for _ in procs:
            try:
                r, status, out = q.get(timeout=timeout)
            except queue.Empty:
                missing = sorted(set(range(world)) - set(got))
                sys.exit(f"{tool}: no answer from rank(s) {missing} within {timeout} s")
            if status != "ok":
                sys.exit(f"{tool}: rank {r} failed:\n{out}")
            got[r] = out
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return got
