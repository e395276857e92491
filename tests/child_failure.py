"""One rank of a failure scenario of test_failure_gpu.py, run as a script:

    python child_failure.py SCENARIO RANK UID_HEX|- TIMEOUT

It reports progress as "EVENT {json}" lines on stdout (name, wall-clock time
t, details), which the parent reads to decide when to kill or interrupt whom
and to measure how long the survivors took.  With UID "-" it makes the
unique id itself (so the pytest process never loads NCCL) and reports it.
"""
import json
import os
import sys
import time

import torch

import pyccl


def event(name, **kw):
    print("EVENT " + json.dumps(dict(name=name, t=time.time(), pid=os.getpid(), **kw)), flush=True)


def failure(e, t0=None):
    return dict(type=type(e).__name__, msg=str(e), is_timeout=isinstance(e, pyccl.NcclTimeoutError),
                is_nccl=isinstance(e, pyccl.NcclError), took=None if t0 is None else time.time() - t0)


def warm_up(comm, algo=None):
    """One checked all_reduce: both ranks connected and agreeing."""
    t = torch.full((4096,), float(comm.rank + 1), device=f"cuda:{comm.device}")
    comm.all_reduce(t, algo=algo)
    comm.wait()
    assert torch.equal(t.cpu(), torch.full((4096,), 3.0)), t[:4]


def recover(rank, timeout):
    """A fresh one-rank communicator in this process computes correctly."""
    dev = "cuda"
    c = pyccl.Communicator(1, pyccl.unique_id(), 0, timeout=timeout)
    x = torch.arange(1, 1024 * 1024 + 4, dtype=torch.float32, device=dev)
    out = torch.zeros_like(x)
    c.all_reduce(x, out=out)
    y = torch.arange(7, dtype=torch.int64, device=dev) * 3
    c.all_reduce(y, op=pyccl.MAX)
    c.wait()
    assert torch.equal(out.cpu(), x.cpu())
    assert y.cpu().tolist() == [0, 3, 6, 9, 12, 15, 18]
    c.destroy()
    event("recovered")


# ---------------------------------------------------------------- scenarios

def killed_peer(rank, uid, timeout, algo=None):
    """Both ranks loop over all_reduces; the parent SIGKILLs rank 1."""
    comm = pyccl.Communicator(2, uid, rank, timeout=timeout)
    dev = "cuda"
    t = torch.empty(1 << 16, device=dev)
    want = torch.full((1 << 16,), 3.0)
    i = 0
    try:
        while True:
            t.fill_(rank + 1)
            comm.all_reduce(t, algo=algo)
            i += 1
            if i % 50 == 0:
                comm.wait()   # the result is complete: reading it cannot block
                assert torch.equal(t.cpu(), want), (i, t[:4])
            if i == 300:
                event("looping")
    except pyccl.NcclError as e:
        event("raised", iters=i, **failure(e))
    # the communicator stays unusable, and says why
    try:
        comm.all_reduce(t)
    except pyccl.NcclError as e:
        event("raised_again", **failure(e))
    assert comm.destroyed
    comm.destroy()
    recover(rank, timeout)


def killed_peer_nccl(rank, uid, timeout):
    """killed_peer on NCCL's kernels (its transport sees the death, or the watchdog does)."""
    killed_peer(rank, uid, timeout, "nccl")


def killed_peer_own(rank, uid, timeout):
    """killed_peer on pyccl's own kernels (a kernel waiting on the dead peer's memory)."""
    killed_peer(rank, uid, timeout, "oneshot")


def killed_peer_untimed_own(rank, uid, timeout):
    """A communicator without a timeout, pyccl's own kernels in a loop on a thread; the parent
    SIGKILLs rank 1.  Rank 0's kernel then waits for ever (no timeout, as NCCL's would), the
    loop's thread waits a bounded number of launches ahead with the GIL released (not in a full
    launch queue holding it), so this thread runs on and its abort() ends the loop's call."""
    untimed_loop_then_abort(rank, uid, timeout, "oneshot")


def stopped_peer_untimed_nccl(rank, uid, timeout):
    """The same on NCCL's kernels: the parent SIGSTOPs rank 1, so NCCL's sockets stay open and
    nothing tells rank 0 (as with a peer dead across NVLink between two GPUs); rank 0's NCCL
    kernel waits for ever, the loop's thread waits a bounded number of calls ahead without the
    communicator's lock (not inside NCCL's launch behind a full queue, holding it), so abort()
    from this thread takes the lock and ends the loop's call."""
    untimed_loop_then_abort(rank, uid, timeout, "nccl")


def stopped_peer_untimed_nccl_group(rank, uid, timeout):
    """The same with a loop of pyccl.group()s of two NCCL all_reduces, which NCCL launches at
    the group's end, outside the communicator's lock, while the group holds the communicator
    (abort() refuses one in a group): the group's end waits for the mark 16 back after the
    communicator left the group, so abort() from this thread ends that wait."""
    untimed_loop_then_abort(rank, uid, timeout, "nccl", group=2)


def untimed_loop_then_abort(rank, uid, timeout, algo, group=0):
    import threading
    comm = pyccl.Communicator(2, uid, rank)
    warm_up(comm, algo)
    t = torch.arange(1 << 14, dtype=torch.float32, device=f"cuda:{comm.device}")
    state = {"i": 0}

    def loop():
        torch.cuda.set_device(comm.device)
        try:
            while True:
                if group:
                    with pyccl.group():
                        for _ in range(group):
                            comm.all_reduce(t, algo=algo)
                else:
                    comm.all_reduce(t, algo=algo)
                state["i"] += 1
                if state["i"] == 300:
                    event("looping")
        except BaseException as e:  # noqa: BLE001 (reported)
            state["ended"] = time.time()
            state["err"] = e

    th = threading.Thread(target=loop, daemon=True)
    th.start()
    while state["i"] < 300 and "err" not in state:
        time.sleep(0.01)
    # the parent kills or stops rank 1 now: the count stops moving, and this thread keeps running
    last, since = state["i"], time.time()
    while time.time() - since < 3.0 and "err" not in state:
        time.sleep(0.01)
        if state["i"] != last:
            last, since = state["i"], time.time()
    event("stuck", iters=state["i"], err=repr(state.get("err")))
    t0 = time.time()
    comm.abort()
    took = time.time() - t0
    th.join(30)
    e = state.get("err")
    event("raised", alive=th.is_alive(), iters=state["i"], abort_took=took,
          after_abort=state["ended"] - t0 if "ended" in state else None,
          **(failure(e) if e is not None else {}))
    comm.destroy()
    recover(rank, timeout)
    event("done")


# absent_peer's cases: (name, algo of rank 0's call, warmed up by both ranks)
ABSENT_CASES = (("unconnected-own", None, False), ("unconnected-nccl", "nccl", False),
                ("connected-own", None, True), ("connected-nccl", "nccl", True))


def absent_peer(rank, uid, timeout):
    """Rank 1 holds four communicators but calls nothing on them after a
    warm-up; rank 0's calls must fail within the timeout.  Unconnected: never
    used by rank 1 (rank 0's first call cannot set up pyccl's kernels, or
    NCCL cannot connect); connected: warmed up together, then rank 1 stays
    away (rank 0's kernel, pyccl's or NCCL's, waits on the GPU)."""
    a = pyccl.Communicator(2, uid, rank, timeout=timeout)
    comms = [a] + [a.split(0) for _ in ABSENT_CASES[1:]]
    for comm, (_, algo, warm) in zip(comms, ABSENT_CASES):
        if warm:
            warm_up(comm, algo)
    event("ready")
    if rank == 1:
        time.sleep(len(ABSENT_CASES) * 3 * timeout)   # the parent kills us before
        event("leaving")
        return
    dev = "cuda"
    for comm, (name, algo, _) in zip(comms, ABSENT_CASES):
        t = torch.ones(1 << 20, device=dev)   # 4 MiB: pyccl's own kernels under algo=None
        t0 = time.time()
        where = "all_reduce"
        try:
            comm.all_reduce(t, algo=algo)
            where = "wait"
            comm.wait()
            event("no_error", case=name)
        except pyccl.NcclError as e:
            event("raised", case=name, where=where, **failure(e, t0))
    recover(rank, timeout)


def wrong_world_size(rank, uid, timeout):
    """world_size=3 with only 2 processes: init must give up."""
    t0 = time.time()
    try:
        pyccl.Communicator(3, uid, rank, timeout=timeout)
        event("no_error")
    except pyccl.NcclError as e:
        event("raised", **failure(e, t0))
    sys.stdin.readline()  # the parent says when both ranks gave up
    recover(rank, timeout)


def sigint_in_wait(rank, uid, timeout):
    """Rank 0 blocks in comm.wait() on work rank 1 never joins; the parent
    sends SIGINT to rank 0."""
    comm = pyccl.Communicator(2, uid, rank, timeout=timeout)
    warm_up(comm)
    if rank == 1:
        event("ready")
        time.sleep(timeout)
        return
    t = torch.ones(1 << 20, device="cuda")
    comm.all_reduce(t)
    event("waiting")
    comm.wait()
    event("no_error")


WORLD = int(os.environ.get("FAILURE_WORLD", "2"))


def survivors_shrink(rank, uid, timeout):
    """WORLD ranks loop over own-kernel all_reduces of exact data; the parent SIGKILLs the
    last rank.  The others raise, shrink() the failed communicator to the ranks left, and
    finish the loop there, every 25th result checked bitwise."""
    victim = WORLD - 1
    comm = pyccl.Communicator(WORLD, uid, rank, timeout=timeout)
    members = list(range(WORLD))  # the original ranks of the current communicator, in order
    t = torch.empty(1 << 16, device="cuda")
    i, shrunk = 0, 0
    while i < 600:
        t.fill_(rank + 1 + i % 7)
        try:
            comm.all_reduce(t)
            if i % 25 == 0 or i == 599:
                comm.wait()
                want = float(sum(m + 1 + i % 7 for m in members))
                assert torch.equal(t.cpu(), torch.full((1 << 16,), want)), (i, members, t[:4])
            if i == 300 and not shrunk:
                event("looping", state=comm.all_reduce_info["state"])
        except pyccl.NcclError as e:
            event("raised", iters=i, **failure(e))
            t0 = time.time()
            new = comm.shrink(exclude=[members.index(victim)])
            comm.destroy()  # the failed one: its kept handle and region go
            comm = new
            members.remove(victim)
            shrunk += 1
            event("shrunk", took=time.time() - t0, rank=comm.rank, size=comm.size)
            continue  # this step again, on the ranks left
        i += 1
    comm.wait()
    event("finished", iters=i, shrunk=shrunk, state=comm.all_reduce_info["state"],
          parked=comm.all_reduce_info["parked"])
    comm.destroy()


if __name__ == "__main__":
    scenario, rank, uid_hex, timeout = sys.argv[1], int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
    pyccl.place_rank(rank, WORLD)  # WORLD processes; they share a GPU where there is one
    if uid_hex == "-":
        uid = pyccl.unique_id()
        event("uid", uid=uid.hex())
    else:
        uid = bytes.fromhex(uid_hex)
    # Start together: rank 1 is launched only once rank 0 reported the id and
    # needs seconds to import torch, which must not eat into a 5 s init timeout.
    start = os.path.join("/tmp", "pyccl-start-" + uid.hex()[:24])
    os.makedirs(start, exist_ok=True)
    open(os.path.join(start, str(rank)), "w").close()
    deadline = time.time() + 120
    while not all(os.path.exists(os.path.join(start, str(r))) for r in range(WORLD)):
        if time.time() > deadline:
            raise SystemExit(f"rank {rank}: the other process never started")
        time.sleep(0.01)
    globals()[scenario](rank, uid, timeout)
    event("done")
