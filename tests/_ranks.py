"""Run a function in one spawned process per rank, bounded in time.

The parent makes the unique id; each child sets its GPU, builds a
Communicator and runs the scenario, which checks its own results and returns
something picklable.  A child that raises reports its traceback; a child that
hangs is killed at the deadline and the test fails, never hangs.
"""
import multiprocessing as mp
import os
import traceback

import torch


def _child(fn_name, module, rank, world, uid, q, env, extra):
    try:
        os.environ.update(env)
        # W processes each with a thread per core oversubscribe the CPU many times
        # over and make the float64 references crawl at 4+ ranks.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, world)))
        import importlib

        import pyccl

        torch.cuda.set_device(rank % torch.cuda.device_count())
        fn = getattr(importlib.import_module(module), fn_name)
        if uid is None:
            out = fn(rank, world, *extra)
        else:
            comm = pyccl.Communicator(world, uid, rank)
            out = fn(comm, *extra)
        q.put((rank, "ok", out))
    except BaseException:
        q.put((rank, "error", traceback.format_exc()))


def run_ranks(fn, world, *extra, timeout=240, env=None, make_comm=True):
    """Results of fn(comm, *extra) (or fn(rank, world, *extra)) per rank."""
    import pyccl

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    uid = pyccl.unique_id() if make_comm else None
    procs = [ctx.Process(target=_child, args=(fn.__name__, fn.__module__, r, world, uid, q, env or {}, extra))
             for r in range(world)]
    for p in procs:
        p.start()
    results, errors = {}, []
    try:
        for _ in range(world):
            rank, status, out = q.get(timeout=timeout)
            if status == "ok":
                results[rank] = out
            else:
                errors.append(f"rank {rank}:\n{out}")
                break  # peers of a failed rank may wait forever: stop now
    except Exception as e:  # queue.Empty: someone hung
        errors.append(f"timed out after {timeout}s waiting for ranks ({e!r})")
    finally:
        for p in procs:
            p.join(timeout=5 if errors else 60)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
    assert not errors, "\n".join(errors)
    return results
