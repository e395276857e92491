"""Runs the benchmark on GPUs and streams raw measurements back to the parent process.

Each system runs in freshly spawned processes: one per rank for the per-rank APIs (pyccl's
Communicator, torch.distributed), one driving every GPU for the list-of-tensors APIs
(pyccl.nccl, torch.cuda.nccl). Children time with CUDA events, verify with `data`, and put
per-rank results on a queue; the parent aggregates them (max over ranks by default). The parent
only counts devices, makes the pyccl unique id and a loopback port, and never waits without a
deadline: a silent, dead or stuck child gets every process of the run killed and a BenchError.
pyccl and torch's CUDA parts are imported inside the functions, so this module loads anywhere.
"""
import queue as queue_mod
import socket
import time
import traceback

from . import data as D
from . import report as R
from . import sizes as S
from .drivers import CPU_SYSTEM, PER_RANK, SINGLE, SYSTEMS, make_driver  # noqa: F401

EXIT_GRACE_S = 30.0


class BenchError(RuntimeError):
    """A benchmark run failed; the message says which system, which process and why."""


def cuda_device_count():
    try:
        import torch
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # a broken driver install reads as "no GPU", not a traceback
        return 0


# ---- child side -------------------------------------------------------------------------------

def _time(drv, call, cfg):
    """Seconds per iteration for each local device and each loop (warm-ups excluded)."""
    import torch
    for _ in range(cfg["warmup"]):
        call()
    drv.sync()
    drv.barrier()
    graph, per_loop = None, cfg["iters"]
    if cfg["graph"] > 0:
        graph = torch.cuda.CUDAGraph()
        # Thread-local mode, as nccl-tests: NCCL may allocate while connecting during capture.
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            for _ in range(cfg["iters"]):
                call()
        per_loop *= cfg["graph"]
        drv.sync()
        drv.barrier()
    streams, out = drv.streams(), [[] for _ in drv.devices]
    for _ in range(cfg["repeats"]):
        events = [(drv.event(), drv.event()) for _ in streams]
        drv.barrier()  # ranks start together, so no rank's events time waiting for a late peer
        for (start, _), s in zip(events, streams):
            start.record(s)
        if graph is not None:
            for _ in range(cfg["graph"]):
                graph.replay()
        else:
            for _ in range(cfg["iters"]):
                call()
                if cfg["blocking"]:
                    drv.sync()
                    drv.barrier()
        for (_, end), s in zip(events, streams):
            end.record(s)
        drv.sync()
        for k, (start, end) in enumerate(events):
            out[k].append(start.elapsed_time(end) * 1e-3 / per_loop)
    del graph
    return out


def _check(drv, call, bufs, coll, count, dtype, op, root, cfg, seed):
    """Wrong elements per local device over up to cfg['check'] fresh runs, or None if off."""
    if cfg["check"] <= 0:
        return None
    wrong = [0] * len(bufs)
    for c in range(cfg["check"]):
        s = seed * 1000 + c
        for (inp, out), r in zip(bufs, drv.ranks):
            out.zero_()  # before filling: in-place, the input lies inside the output
            D.fill(inp, coll, r, drv.nranks, dtype, op, s)
        drv.sync()
        drv.barrier()
        call()
        drv.sync()
        wrong = [D.count_wrong(out, coll, r, drv.nranks, count, dtype, op, root, s)
                 for (_, out), r in zip(bufs, drv.ranks)]
        if any(wrong):
            break
    return wrong


def _sweep(drv, cfg, q):
    import torch
    seed, n = 0, drv.nranks
    for coll in cfg["colls"]:
        for dtype in cfg["dtypes"]:
            tdtype, el = getattr(torch, S.DTYPES[dtype][0]), S.elem_size(dtype)
            counts = [S.coll_counts(coll, size, el, n) for size in cfg["sizes"]]
            cap = max([max(c.sendcount, c.recvcount) for c in counts] + [1])
            send = [torch.empty(cap, dtype=tdtype, device=drv.place(d)) for d in drv.devices]
            recv = [torch.empty(cap, dtype=tdtype, device=drv.place(d)) for d in drv.devices]
            for op in S.ops_for(coll, cfg["ops"]):
                for si, cc in enumerate(counts):
                    entries = {}
                    for placement in R.PLACEMENTS:
                        bufs = [D.views(coll, placement, send[k], recv[k], cc, r)
                                for k, r in enumerate(drv.ranks)]
                        call = drv.build(coll, placement, op, cfg["root"], bufs)
                        if call is None or (cfg["graph"] > 0 and not drv.can_graph):
                            entries[placement] = None
                            continue
                        seed += 1
                        for (inp, _), r in zip(bufs, drv.ranks):
                            D.fill(inp, coll, r, n, dtype, op, seed)
                        times = _time(drv, call, cfg)
                        wrong = _check(drv, call, bufs, coll, cc.count, dtype, op, cfg["root"],
                                       cfg, seed)
                        entries[placement] = {"times": times, "wrong": wrong}
                    q.put(("row", (coll, dtype, op, si), drv.ranks, entries))
            del send, recv


def _host(drv, cfg, q):
    """Host and GPU time per all_reduce call on one float: many calls, one sync at the end."""
    import torch
    xs = [torch.randint(1, 8, (1,), device=drv.place(d)).float() for d in drv.devices]
    call = drv.build("all_reduce", "in-place", "sum", 0, [(x, x) for x in xs])
    for _ in range(max(cfg["warmup"], 20)):
        call()
    drv.sync()
    streams, calls = drv.streams(), cfg["host_iters"]
    host, gpu = [], [[] for _ in drv.devices]
    for _ in range(cfg["repeats"]):
        events = [(drv.event(), drv.event()) for _ in streams]
        drv.barrier()
        for (start, _), s in zip(events, streams):
            start.record(s)
        t0 = time.perf_counter()
        for _ in range(calls):
            call()
        t1 = time.perf_counter()
        for (_, end), s in zip(events, streams):
            end.record(s)
        drv.sync()
        host.append((t1 - t0) / calls)
        for k, (start, end) in enumerate(events):
            gpu[k].append(start.elapsed_time(end) * 1e-3 / calls)
    q.put(("host", drv.ranks, [host] * len(drv.devices), gpu))


def _child(system, index, rank, nranks, cfg, rendezvous, q, barrier):
    """Process entry point (spawned): run one system's share of the benchmark."""
    try:
        drv = make_driver(system, rank, nranks, rendezvous, barrier, cfg["timeout"])
        if cfg.get("_hang_rank") == rank:  # test hooks: a rank that never answers, or fails
            time.sleep(1e9)
        if cfg.get("_fail_rank") == rank:
            raise RuntimeError(f"rank {rank} fails on purpose")
        q.put(("info", [drv.describe(r, d) for r, d in zip(drv.ranks, drv.devices)]))
        (_host if cfg["mode"] == "host" else _sweep)(drv, cfg, q)
        drv.close()
        q.put(("done", index))
    except BaseException:
        q.put(("error", index, traceback.format_exc()))
        raise SystemExit(1)


# ---- parent side ------------------------------------------------------------------------------

def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill(procs):
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(5)


def _exit_text(code):
    return f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"


def _run(system, nranks, cfg, handle):
    """Spawn the processes of one system and feed their messages to handle() until all are done."""
    import torch.multiprocessing as tmp
    ctx = tmp.get_context("spawn")
    q = ctx.Queue()
    if system in SINGLE:
        specs, barrier, rdv = [None], None, None
    else:
        barrier = ctx.Barrier(nranks)
        if system == "pyccl":
            try:
                import pyccl
                rdv = pyccl.unique_id()
            except ImportError as e:
                raise BenchError(f"pyccl: cannot import pyccl ({e}); build the extension first")
            except Exception as e:
                raise BenchError(f"pyccl: unique_id() failed: {type(e).__name__}: {e}")
        else:
            rdv = _free_port()
        specs = list(range(nranks))
    procs = [ctx.Process(target=_child, args=(system, i, rank, nranks, cfg, rdv, q, barrier),
                         daemon=True, name=f"pyccl.bench {system} {i}")
             for i, rank in enumerate(specs)]
    done, dead_since, last = set(), {}, time.monotonic()
    try:
        for p in procs:
            p.start()
        while len(done) < len(procs):
            try:
                msg = q.get(timeout=0.5)
            except queue_mod.Empty:
                now = time.monotonic()
                for i, p in enumerate(procs):
                    if i in done or p.is_alive():
                        continue
                    since = dead_since.setdefault(i, now)
                    if p.exitcode != 0 or now - since > 5.0:
                        raise BenchError(f"{system}: process {i} ended with "
                                         f"{_exit_text(p.exitcode)} before reporting its results")
                if now - last > cfg["timeout"]:
                    waiting = [i for i in range(len(procs)) if i not in done]
                    raise BenchError(f"{system}: no progress for {cfg['timeout']:.0f} s (processes "
                                     f"{waiting} still running); killed them. Raise -T/--timeout "
                                     "if one size legitimately takes longer")
                continue
            last = time.monotonic()
            if msg[0] == "error":
                raise BenchError(f"{system}: process {msg[1]} failed:\n{msg[2].rstrip()}")
            if msg[0] == "done":
                done.add(msg[1])
            else:
                handle(msg)
    except BaseException:
        _kill(procs)
        raise
    deadline = time.monotonic() + EXIT_GRACE_S
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
    stuck = [i for i, p in enumerate(procs) if p.is_alive()]
    if stuck:
        _kill(procs)
        raise BenchError(f"{system}: processes {stuck} reported all results but did not exit "
                         f"within {EXIT_GRACE_S:.0f} s; killed them")


def plan_length(cfg):
    return sum(len(cfg["dtypes"]) * len(S.ops_for(c, cfg["ops"])) * len(cfg["sizes"])
               for c in cfg["colls"])


def run_sweep(system, nranks, cfg, on_info=None, on_row=None, on_progress=None):
    """Run the size sweep of cfg on one system; returns the list of report.Result."""
    results, infos, slots, total = [], [], {}, plan_length(cfg)

    def handle(msg):
        if msg[0] == "info":
            infos.extend(msg[1])
            if len(infos) == nranks and on_info:
                on_info(sorted(infos))
            return
        _, key, ranks, entries = msg
        slot = slots.setdefault(key, {"n": 0, **{p: {} for p in R.PLACEMENTS}})
        slot["n"] += len(ranks)
        for p, e in entries.items():
            if e is None:
                slot[p] = None
            elif slot[p] is not None:
                wrong = e["wrong"] or [None] * len(ranks)
                slot[p].update(zip(ranks, zip(e["times"], wrong)))
        if slot["n"] < nranks:
            return
        del slots[key]
        coll, dtype, op, si = key
        row = []
        for p in R.PLACEMENTS:
            per_rank = wrongs = None
            if slot[p] is not None:
                per_rank = [slot[p][r][0] for r in sorted(slot[p])]
                wrongs = [slot[p][r][1] for r in sorted(slot[p])]
            row.append(R.make_result(system, coll, dtype, op, cfg["root"], cfg["sizes"][si],
                                     nranks, p, per_rank, wrongs, cfg["average"]))
        results.extend(row)
        if on_row:
            on_row(*row)
        if on_progress:
            on_progress(system, len(results) // 2, total, f"{coll} {dtype} {op} {row[0].size} B")

    _run(system, nranks, cfg, handle)
    return results


def run_host_overhead(system, nranks, cfg):
    """Host/GPU microseconds per 1-element all_reduce call; maximum over ranks."""
    host, gpu = {}, {}

    def handle(msg):
        if msg[0] == "host":
            _, ranks, h, g = msg
            host.update(zip(ranks, h))
            gpu.update(zip(ranks, g))

    _run(system, nranks, cfg, handle)
    if len(host) != nranks:
        raise BenchError(f"{system}: host overhead came back from {len(host)} of {nranks} ranks")
    ranks = sorted(host)
    return R.HostResult(system, nranks, cfg["host_iters"],
                        R.aggregate_times([host[r] for r in ranks], 3) * 1e6,
                        R.aggregate_times([gpu[r] for r in ranks], 3) * 1e6)
