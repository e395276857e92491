"""Runs the benchmark on GPUs and streams raw measurements back to the parent process.

Each system runs in freshly spawned processes: one per rank for the per-rank APIs (pyccl's
Communicator, torch.distributed), one driving every GPU for the list-of-tensors APIs
(pyccl.nccl, torch.cuda.nccl). Children time with CUDA events, verify with `data`, and send
per-rank results through a pipe each; the parent aggregates them (max over ranks by default).
The parent only counts devices, makes the pyccl unique id and a loopback port, and never waits
without a deadline: a silent, dead or stuck child gets every process of the run (and anything
it started) killed and a BenchError. A child that makes no progress for most of the timeout
dumps its Python stacks to stderr (faulthandler; spawned children share the parent's stderr),
so a hang shows where it is; the processes of a run take turns, so dumps do not interleave.
Start-up (spawn, importing torch and pyccl: seconds on a loaded machine), before a process can
report or dump anything, gets at least START_S before the run is killed. Children die with the
parent (PR_SET_PDEATHSIG on Linux), so a killed benchmark leaves no process holding a GPU.
Spawning, pipes, killing and reaping are spawn.py's, which the tests' harness shares.
pyccl and torch's CUDA parts are imported inside the functions, so this module loads anywhere.
"""
from __future__ import annotations

import faulthandler
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from . import algos
from . import data
from . import report
from . import sizes
from . import spawn
from .drivers import (  # noqa: F401
    CPU_LISTS_SYSTEM, CPU_SYSTEM, DIST_PYCCL, ONE_PROCESS, PER_RANK, SINGLE, SYMM_SYSTEM, SYSTEMS,
    make_driver)

if TYPE_CHECKING:
    from multiprocessing.connection import Connection
    from multiprocessing.synchronize import Lock
    from typing import TextIO

EXIT_GRACE_S = 30.0
KILL_WAIT_S = 20.0  # after SIGKILL: a process tearing down GPU contexts can take a few seconds
# Until every process has sent its first message the parent waits max(timeout, START_S) without
# progress: a process still importing torch has no watchdog yet, so a kill then (a short -T on a
# busy machine) would come without any stack dump, for processes that were not even stuck.
START_S = 60.0
# on_progress(system, done, total, what): one more measurement came back
_Progress = Callable[[str, int, int, str], object]


class BenchError(RuntimeError):
    """A benchmark run failed; the message says which system, which process and why."""


def cuda_device_count() -> int:
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
    """Most wrong elements per local device in cfg['check'] fresh runs, or None if off.

    Every rank runs all cfg['check'] runs: stopping at the first wrong run would be a decision
    made per rank (a reduce's non-root ranks never see wrong elements), and a rank that stopped
    early would leave its peers waiting in a barrier or collective it never joins."""
    if cfg["check"] <= 0:
        return None
    wrong = [0] * len(bufs)
    for c in range(cfg["check"]):
        s = seed * 1000 + c
        for (inp, out), r in zip(bufs, drv.ranks):
            out.zero_()  # before filling: in-place, the input lies inside the output
            data.fill(inp, coll, r, drv.nranks, dtype, op, s)
        drv.sync()
        drv.barrier()
        call()
        drv.sync()
        wrong = [max(w, data.count_wrong(out, coll, r, drv.nranks, count, dtype, op, root, s))
                 for w, (_, out), r in zip(wrong, bufs, drv.ranks)]
    return wrong


def _sweep(drv, cfg, out):
    import torch
    seed, n = 0, drv.nranks
    for coll in cfg["colls"]:
        for dtype in cfg["dtypes"]:
            tdtype, el = getattr(torch, sizes.DTYPES[dtype][0]), sizes.elem_size(dtype)
            counts = [sizes.coll_counts(coll, size, el, n) for size in cfg["sizes"]]
            cap = max([max(c.sendcount, c.recvcount) for c in counts] + [1])
            if hasattr(drv, "buffers"):  # nccl-symm: registered windows
                send, recv = (list(x) for x in zip(*[drv.buffers(cap, tdtype, d) for d in drv.devices]))
            else:
                send = [torch.empty(cap, dtype=tdtype, device=drv.place(d)) for d in drv.devices]
                recv = [torch.empty(cap, dtype=tdtype, device=drv.place(d)) for d in drv.devices]
            for op in sizes.ops_for(coll, cfg["ops"]):
                for si, cc in enumerate(counts):
                    entries = {}
                    for placement in report.PLACEMENTS:
                        bufs = [data.views(coll, placement, send[k], recv[k], cc, r)
                                for k, r in enumerate(drv.ranks)]
                        call = drv.build(coll, placement, op, cfg["root"], bufs)
                        if call is None or (cfg["graph"] > 0 and not drv.can_graph):
                            entries[placement] = None
                            continue
                        seed += 1
                        for (inp, _), r in zip(bufs, drv.ranks):
                            data.fill(inp, coll, r, n, dtype, op, seed)
                        times = _time(drv, call, cfg)
                        wrong = _check(drv, call, bufs, coll, cc.count, dtype, op, cfg["root"],
                                       cfg, seed)
                        entries[placement] = {"times": times, "wrong": wrong}
                    out.put(("row", (coll, dtype, op, si), drv.ranks, entries))
            if hasattr(drv, "release"):
                drv.release()
            del send, recv


def _host(drv, cfg, out):
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
    out.put(("host", drv.ranks, [host] * len(drv.devices), gpu))


# what a child runs for each mode (--algos and --host-breakdown: pyccl's per-rank API only)
MODES: dict[str, Callable[[Any, Mapping[str, Any], _Reporter], None]] = {
    "sweep": _sweep, "host": _host, "algos": algos.algo_sweep, "breakdown": algos.host_breakdown}


def dump_after(timeout: float) -> float:
    """Seconds without progress after which a child dumps its stacks: before the parent's kill."""
    return max(0.5, timeout - min(10.0, timeout / 3.0))


class _Reporter:
    """A child's end of its pipe to the parent; each message is progress. send() is synchronous:
    no feeder thread that a main thread stuck holding the GIL would starve. After
    dump_after(timeout) seconds without progress (shortly before the parent kills the run) a
    watchdog thread writes a line naming the process and its Python stacks (faulthandler) to
    stderr, which children share with the parent, and again after as long again. faulthandler's
    own C timer backs it up a moment later in case the main thread is stuck in C code holding
    the GIL (then the stacks come without the naming line). The processes of a run share
    dump_lock, held while one writes its line and stacks: ranks stuck together dump at the same
    moment, and faulthandler writes in small pieces, which would interleave. SIGUSR1 dumps the
    stacks on demand (kill -USR1 PID)."""
    conn: Connection
    label: str
    after: float
    lock: Lock | None
    lead: float
    file: TextIO | None
    last: float
    dumped: bool

    def __init__(self, conn: Connection, label: str, timeout: float, dump_lock: Lock | None = None) -> None:
        import threading
        self.conn, self.label, self.after = conn, label, dump_after(timeout)
        self.lock = dump_lock
        self.lead = min(1.0, self.after / 4)
        self.file = sys.stderr if sys.stderr is not None else sys.__stderr__
        self.last, self.dumped = time.monotonic(), False
        if self.file is None:
            return
        faulthandler.enable(file=self.file, all_threads=True)  # crashes (SIGSEGV...) too
        if hasattr(signal, "SIGUSR1"):
            faulthandler.register(signal.SIGUSR1, file=self.file, all_threads=True)
        self.arm()
        threading.Thread(target=self._watch, name="pyccl.bench watchdog", daemon=True).start()

    def _arm_fallback(self, delay: float) -> None:
        faulthandler.dump_traceback_later(delay, repeat=True, file=self.file, exit=False)

    def arm(self) -> None:
        self.last, self.dumped = time.monotonic(), False
        if self.file is not None:
            self._arm_fallback(self.after + self.lead)

    def put(self, msg: object) -> None:
        self.conn.send(msg)
        self.arm()

    def _watch(self) -> None:
        while True:
            time.sleep(self.lead / 2)
            quiet = time.monotonic() - self.last
            if quiet < self.after or (self.dumped and quiet < 2 * self.after):
                continue
            # Wait a moment for another process's dump to end; past that, better interleaved
            # than missing (a process died holding the lock).
            locked = self.lock is not None and self.lock.acquire(timeout=self.lead)
            try:
                self._arm_fallback(self.after + self.lead)  # this dump replaces the fallback's
                print(f"[pyccl.bench] {self.label} (pid {os.getpid()}): no progress for "
                      f"{quiet:.0f} s; its Python stacks (most recent call first):",
                      file=self.file, flush=True)
                faulthandler.dump_traceback(file=self.file, all_threads=True)
                self.file.flush()
            except Exception:
                pass
            finally:
                if locked:
                    self.lock.release()
            if self.dumped:
                self.last = time.monotonic() - self.after  # next one after as long again
            self.dumped = True

    def close(self) -> None:
        if self.file is not None:
            faulthandler.cancel_dump_traceback_later()


def _test_hook(cfg, name, index):
    """Test hooks name a process index (the rank for per-rank systems); absent means off."""
    return cfg.get(name) is not None and cfg[name] == index


def _child(system, index, rank, nranks, cfg, rendezvous, barrier, dump_lock, conn):
    """Process entry point (spawned): run one system's share of the benchmark, sending messages
    to the parent through conn, the write end of this process's own pipe."""
    if cfg.get("_parent_pid"):
        spawn.die_with_parent(cfg["_parent_pid"])
    out = _Reporter(conn, f"{system} process {index}", cfg["timeout"], dump_lock)
    out.put(("hello", index))  # the parent's no-progress clock now starts after this one's
    try:
        drv = make_driver(system, rank, nranks, rendezvous, barrier, cfg["timeout"])
        if _test_hook(cfg, "_hang_rank", index):  # test hooks: a process that never answers,
            time.sleep(1e9)
        if _test_hook(cfg, "_hang_gil_rank", index):  # one stuck in C code holding the GIL,
            import ctypes
            ctypes.PyDLL(None).sleep(1000000)
        if _test_hook(cfg, "_fail_rank", index):  # or one that fails
            raise RuntimeError(f"rank {rank} fails on purpose")
        if _test_hook(cfg, "_die_rank", index):  # or one that dies without a word
            os._exit(3)
        out.put(("info", [drv.describe(r, d) for r, d in zip(drv.ranks, drv.devices)]))
        MODES[cfg["mode"]](drv, cfg, out)
        drv.close()
        out.close()
        conn.send(("done", index))
    except BaseException:
        out.close()
        conn.send(("error", index, traceback.format_exc()))
        raise SystemExit(1)


# ---- parent side ------------------------------------------------------------------------------

def _kill(procs, wait=KILL_WAIT_S):
    """spawn.kill_all, saying so when a process outlives its SIGKILL."""
    left = spawn.kill_all(procs, wait)
    if left:
        print(f"pyccl.bench: warning: process(es) {left} still alive {wait:.0f} s after SIGKILL "
              "(stuck in the GPU driver?); a next run may find the GPUs busy", file=sys.stderr,
              flush=True)
    return left


def _pids(procs, which):
    return ", ".join(f"{i} (pid {procs[i].pid})" for i in which)


def _run(system, nranks, cfg, handle):
    """Spawn the processes of one system and feed their messages to handle() until all are done.

    Each child writes to its own pipe (spawn.start): the parent sees every message a child sent
    before it died (then end-of-file), so a crash is reported with its traceback at once.
    torch.distributed's rendezvous port stays reserved for the whole run (a port probed free and
    let go could be taken before rank 0's store binds it: seen as EADDRINUSE in the CPU tests).
    Even so rank 0's store was refused its port now and then (EADDRINUSE from listen(), on an
    H100 machine and in the CPU tests): a run that failed that way, in init_process_group and so
    before any result, runs again on another port, at most RENDEZVOUS_TRIES times in all."""
    if system in ONE_PROCESS or system in ("pyccl", SYMM_SYSTEM):
        return _run_on(system, nranks, cfg, handle, None)
    for attempt in range(1, RENDEZVOUS_TRIES + 1):
        with spawn.reserved_port() as port:
            try:
                return _run_on(system, nranks, cfg, handle, port)
            except BenchError as e:
                if attempt == RENDEZVOUS_TRIES or not _port_refused(str(e)):
                    raise
                print(f"[pyccl.bench] {system}: the rendezvous port {port} was refused "
                      f"(EADDRINUSE); again on another port ({attempt + 1}/{RENDEZVOUS_TRIES})",
                      file=sys.stderr, flush=True)


RENDEZVOUS_TRIES = 3


def _port_refused(text):
    """A failure of torch.distributed's rendezvous for want of its port, before any result."""
    return "EADDRINUSE" in text and "init_process_group" in text


def _run_on(system, nranks, cfg, handle, port):
    ctx = spawn.context()
    cfg = dict(cfg, _parent_pid=os.getpid())
    if system in ONE_PROCESS:
        specs, barrier, rdv = [None], None, None
    else:
        barrier = ctx.Barrier(nranks)
        if system in ("pyccl", SYMM_SYSTEM):
            try:
                import pyccl
                rdv = pyccl.unique_id()
            except ImportError as e:
                raise BenchError(f"pyccl: cannot import pyccl ({e}); build the extension first")
            except Exception as e:
                raise BenchError(f"pyccl: unique_id() failed: {type(e).__name__}: {e}")
        else:
            rdv = port
        specs = list(range(nranks))
    dump_lock = ctx.Lock() if len(specs) > 1 else None  # stack dumps take turns
    # _child's conn comes last: spawn.start appends each process's write end
    argsets = [(system, i, rank, nranks, cfg, rdv, barrier, dump_lock)
               for i, rank in enumerate(specs)]
    procs, readers = spawn.start(ctx, _child, argsets,
                                 [f"pyccl.bench {system} {i}" for i in range(len(specs))])
    done, started = set(), set()  # started: sent their first message
    last = t_spawn = time.monotonic()
    try:
        while len(done) < len(procs):
            for i, msg in spawn.receive(readers, 0.5):
                if msg is None:  # end-of-file: everything it sent has been read
                    if i not in done:
                        procs[i].join(5.0)
                        raise BenchError(
                            f"{system}: process {_pids(procs, [i])} ended before reporting its "
                            f"results ({spawn.describe_exit(procs[i].exitcode)})")
                    continue
                last = time.monotonic()
                started.add(i)
                if msg[0] == "error":
                    raise BenchError(f"{system}: process {msg[1]} failed:\n{msg[2].rstrip()}")
                if msg[0] == "done":
                    done.add(msg[1])
                elif msg[0] != "hello":
                    handle(msg)
            # a process that has not said hello yet is still starting (see START_S)
            limit = cfg["timeout"] if len(started) == len(procs) else max(cfg["timeout"], START_S)
            if len(done) < len(procs) and time.monotonic() - last > limit:
                waiting = [i for i in range(len(procs)) if i not in done]
                starting = [i for i in range(len(procs)) if i not in started]
                if starting:
                    raise BenchError(
                        f"{system}: no progress for {limit:.0f} s, and processes "
                        f"{_pids(procs, starting)} had sent nothing "
                        f"{time.monotonic() - t_spawn:.0f} s after their spawn (stuck starting: "
                        "importing torch or pyccl?); killed every process of the run")
                raise BenchError(
                    f"{system}: no progress for {cfg['timeout']:.0f} s (processes "
                    f"{_pids(procs, waiting)} still running); killed them. Their Python stacks, "
                    "if they were stuck, are above on stderr. Raise -T/--timeout if one size "
                    "legitimately takes longer")
    except BaseException:
        _kill(procs)
        raise
    finally:
        spawn.close(readers)
    deadline = time.monotonic() + EXIT_GRACE_S
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
    stuck = [i for i, p in enumerate(procs) if p.is_alive()]
    if stuck:
        text = _pids(procs, stuck)
        _kill(procs)
        raise BenchError(f"{system}: processes {text} reported all results but did not exit "
                         f"within {EXIT_GRACE_S:.0f} s; killed them")


def plan_length(cfg: Mapping[str, Any]) -> int:
    return sum(len(cfg["dtypes"]) * len(sizes.ops_for(c, cfg["ops"])) * len(cfg["sizes"])
               for c in cfg["colls"])


def run_sweep(system: str, nranks: int, cfg: Mapping[str, Any],
              on_info: Callable[[list[str]], object] | None = None,
              on_row: Callable[[report.Result, report.Result], object] | None = None,
              on_progress: _Progress | None = None) -> list[report.Result]:
    """Run the size sweep of cfg on one system; returns the list of report.Result."""
    results, infos, slots, total = [], [], {}, plan_length(cfg)

    def handle(msg):
        if msg[0] == "info":
            infos.extend(msg[1])
            if len(infos) == nranks and on_info:
                on_info(sorted(infos))
            return
        _, key, ranks, entries = msg
        slot = slots.setdefault(key, {"n": 0, **{p: {} for p in report.PLACEMENTS}})
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
        for p in report.PLACEMENTS:
            per_rank = wrongs = None
            if slot[p] is not None:
                per_rank = [slot[p][r][0] for r in sorted(slot[p])]
                wrongs = [slot[p][r][1] for r in sorted(slot[p])]
            row.append(report.make_result(system, coll, dtype, op, cfg["root"], cfg["sizes"][si],
                                          nranks, p, per_rank, wrongs, cfg["average"]))
        results.extend(row)
        if on_row:
            on_row(*row)
        if on_progress:
            on_progress(system, len(results) // 2, total, f"{coll} {dtype} {op} {row[0].size} B")

    _run(system, nranks, cfg, handle)
    return results


def run_host_overhead(system: str, nranks: int, cfg: Mapping[str, Any]) -> report.HostResult:
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
    return report.HostResult(system, nranks, cfg["host_iters"],
                             report.aggregate_times([host[r] for r in ranks], 3) * 1e6,
                             report.aggregate_times([gpu[r] for r in ranks], 3) * 1e6)


def _per_rank_loops(system, nranks, cfg, kind, on_progress=None, total=0):
    """Run one of the per-rank modes; -> ({key: {rank: value}}, all_reduce_info of rank 0)."""
    got, info = {}, {}

    def handle(msg):
        if msg[0] == "algo_info":
            info[msg[1]] = msg[2]
        elif msg[0] == kind:
            key = msg[2]
            got.setdefault(key, {})[msg[1]] = msg[3:] if kind == "breakdown" else msg[3]
            if on_progress and len(got[key]) == nranks:
                on_progress(system, len([k for k in got if len(got[k]) == nranks]), total, str(key))

    _run(system, nranks, cfg, handle)
    short = [k for k, v in got.items() if len(v) != nranks]
    if short:
        raise BenchError(f"{system}: {kind} results for {short[0]} came back from "
                         f"{len(got[short[0]])} of {nranks} ranks")
    return got, info.get(0)


def run_algos(nranks: int, cfg: Mapping[str, Any], on_progress: _Progress | None = None,
              system: str = "pyccl") -> tuple[list[report.AlgoResult], dict[str, Any] | None]:
    """--algos on pyccl's per-rank API: -> ([report.AlgoResult], all_reduce_info of rank 0).
    Each figure is the median over loops of cfg['average'] over ranks (default the maximum)."""
    own = [a for a in cfg["algos"] if a in algos.OWN]
    total = len(cfg["sizes"]) * 3 * (len(cfg["algos"]) + len(own) * len(cfg["variants"])) + 5
    got, info = _per_rank_loops(system, nranks, cfg, "algo", on_progress, total)
    out = []
    for (size, algo, variant, timing), per in got.items():
        iters = (5 if timing in ("per-tensor loop", "coalesced") else
                 algos.FLOOR_CALLS if timing == "launch floor" else algos.algo_iters(cfg, size))
        loops = [per[r] for r in sorted(per)]
        out.append(report.AlgoResult(system, nranks, size, algo, variant, timing, iters,
                                     report.aggregate_times(loops, cfg["average"])))
    return out, info


def run_breakdown(nranks: int, cfg: Mapping[str, Any],
                  system: str = "pyccl") -> tuple[list[report.BreakdownResult], list[dict[str, Any]] | None]:
    """--host-breakdown: -> ([report.BreakdownResult], [all_reduce_info, no-PDL info] of rank 0).
    Each rank's median over loops, then the maximum over ranks, in the order measured."""
    import statistics
    got, info = _per_rank_loops(system, nranks, cfg, "breakdown")
    out = []
    for case, per in got.items():  # dicts keep the order the cases were measured in
        host = max(statistics.median(per[r][0]) for r in per)
        gpu = max(statistics.median(per[r][1]) for r in per)
        out.append(report.BreakdownResult(case, nranks, cfg["host_iters"], host, gpu))
    return out, info
