"""all_reduce latency of the peers pyccl.bench does not drive: torch's symmetric-memory
one-shot and two-shot kernels (torch.ops.symm_mem), and a DDP and an FSDP2 training step on
backend "nccl" against backend "pyccl".  One process per GPU, every rank on a GPU of its own.

  python tools/peers_bench.py symm [-b 8] [-e 64M] [-f 4] [-n 100] [--dtype float,bfloat16]
  python tools/peers_bench.py ddp [--steps 100] [--rounds 5] [--width 1024] [--layers 4] [--profile ROWS]
  python tools/peers_bench.py fsdp [the options of ddp]
  python tools/peers_bench.py timeout [-b 8] [-e 64M] [-f 4] [-n 100]

symm: µs per call, CUDA events around -n back-to-back calls, median of 5 loops, maximum over
ranks, eager and replayed from a CUDA graph; each size is checked first against the exact sum
of the ranks' random inputs, within what rounding in its format allows at the run's rank count
(rounding_error_ratio).  A kernel torch does not have, or that refuses a size or dtype, reads N/A.
Above the table, the launch floor measured in the same processes the same way as the eager
columns: torch.cuda._sleep(0) back to back, one kernel of one thread that returns at once,
launched through torch's direct binding (no operator dispatch): a floor under any eager call
from Python that launches a kernel, GPU µs per call and the host's µs per call.
ddp: ms per training step (forward, backward with DDP's gradient all-reduce, SGD step) of an
MLP on backend "nccl" and on backend "pyccl" in the same processes (a "pyccl" group beside the
"nccl" default group, one DDP copy of the model on each, from the same seed), and the same step
without the all-reduce (a third copy under model.no_sync()): the floor no backend can go under.
Each of the three is timed as the median of 5 loops of --steps steps, maximum over ranks, in each
of --rounds rounds (the backends alternate which goes first, the floor between them); printed:
the median over rounds with the host's time per step beside it (equal to it where the step is
host-bound), each round's figure, pyccl / nccl per round, and per round the part above the floor
of each (pyccl's over nccl's).  A machine's own drift moves all three alike.  --profile N adds
rank 0's N busiest ops per backend; at 2 ranks the parameters after training must be bitwise
equal between the two backends (both add the same two numbers); at more they sum in different
orders, and the largest difference, relative to the largest parameter, is printed.
fsdp: the same for FSDP2: the MLP's Linear layers and the whole model sharded with fully_shard on
a DeviceMesh of a "nccl" and of a "pyccl" group (parameters all-gathered before use, gradients
reduce-scattered), and the floor the same step unsharded with no communication; the parameters
after training gathered whole and compared the same way.
timeout: what a timeout costs, float32 sum in place, the same processes and tensors: a
Communicator without and with timeout= (algo "auto" and "nccl"; with timeout= on a non-blocking
handle, the default, and on a blocking one, "blk"), and dist.all_reduce on a
"pyccl" and an "nccl" group; per call the GPU µs (CUDA events around -n calls) and the host µs
(the same loop's wall time), median of 5 loops, rank 0.
Prints one table; --json FILE writes the rows.
"""
import argparse
import json
import os
import socket
import statistics
import sys
import time
from queue import Empty

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pyccl.bench import sizes


def _size(text):
    """Bytes from '8', '64K', '1M' (pyccl.bench's and nccl-tests' sizes), for argparse."""
    try:
        return sizes.parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _sizes(lo, hi, factor):
    """pyccl.bench's sweep of sizes, the largest one always included."""
    out = sizes.size_list(lo, hi, stepfactor=factor)
    return out if out[-1] == hi else out + [hi]


def _events_us(fn, iters, loops=5):
    """GPU µs per call of fn() (see _timed_loops)."""
    return _timed_loops(lambda _i: fn(), iters, loops)[0] * 1e6


def _timed_loops(fn, iters, loops=5):
    """fn() `iters` times back to back, `loops` times after a barrier: the medians of the GPU time
    (CUDA events around each loop) and of the host's wall time, in seconds per call."""
    gpu, host = [], []
    for _ in range(loops):
        dist.barrier()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        h = time.perf_counter()
        for i in range(iters):
            fn(i)
        h = time.perf_counter() - h
        b.record()
        b.synchronize()
        gpu.append(a.elapsed_time(b) * 1e-3 / iters)
        host.append(h / iters)
    return statistics.median(gpu), statistics.median(host)


def _capture(fn, iters):
    """A CUDA graph of iters calls of fn (one warm-up call outside it first)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(iters):
            fn()
    torch.cuda.synchronize()
    return g


def _max_over_ranks(v):
    t = torch.tensor([v], dtype=torch.float64, device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


# Unit roundoff of each format the symm mode checks: half a unit in the last place of 1.
_UNIT_ROUNDOFF = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


def rounding_error_ratio(got, every, dtype):
    """The worst ratio, over elements, of a sum's error to what rounding in `dtype` allows.

    every: the ranks' inputs (as given, already in `dtype`); got: the all-reduce's result.  A sum
    of N terms added in any order, each partial sum rounded to `dtype` (unit roundoff u), is off
    the exact sum by at most gamma(N-1) * sum|x| with gamma(k) = k*u / (1 - k*u) (Higham,
    "Accuracy and Stability of Numerical Algorithms", 4.2); u * |sum| more covers a sum kept in
    a wider format and rounded once at the end (a margin: from 2 ranks on gamma(N-1) * sum|x|
    alone covers that too).  Relative to sum|x|, not |sum|: random inputs of both signs cancel,
    and the error of a rounded sum follows its partial sums, not the sum.  The inputs' own
    rounding (symm draws them in float32 and rounds them to `dtype`) is no error of the
    all-reduce: the exact sum is taken of the inputs as the ranks hold them.  So the bound grows
    with the rank count, and a result missing a rank's term, or reduced with another op, is far
    outside it wherever the inputs are not all small (the CPU tests: from 1000 elements).  At
    most 1.0 when the result is right."""
    u = _UNIT_ROUNDOFF[dtype]
    k = len(every) - 1
    stacked = torch.stack([e.double() for e in every])
    exact = stacked.sum(0)
    bound = (k * u / (1 - k * u)) * stacked.abs().sum(0) + u * exact.abs()
    err = (got.double() - exact).abs()
    # an exact zero allowed nothing: any error there is an error
    tiny = torch.finfo(torch.float64).tiny
    return (err / bound.clamp_min(tiny)).max().item()


def _launch_floor(iters):
    """GPU µs and host µs per call of torch.cuda._sleep(0) back to back (see _timed_loops), the
    maximum over ranks: at::cuda::sleep launches spin_kernel<<<1, 1>>> on the current stream, and
    with 0 cycles the kernel returns at once, so this is a bare kernel launch from Python."""
    for _ in range(10):
        torch.cuda._sleep(0)
    gpu_s, host_s = _timed_loops(lambda _i: torch.cuda._sleep(0), iters)
    return _max_over_ranks(gpu_s * 1e6), _max_over_ranks(host_s * 1e6)


def symm_table(rows, world):
    """The symm mode's printed lines: the launch floor, the table, what read N/A and why."""
    lines = [f"torch symm_mem all_reduce, {world} ranks, µs per call (max over ranks)"]
    floor = next((r for r in rows if "launch_floor_us" in r), None)
    if floor is not None:
        lines.append(f"launch floor (torch.cuda._sleep(0) back to back, as the eager columns): "
                     f"{floor['launch_floor_us']:.2f} µs per call, host "
                     f"{floor['launch_floor_host_us']:.2f} µs per call")
    lines.append(f"{'dtype':>8} {'bytes':>10} {'one_shot eager':>15} {'graph':>8} "
                 f"{'two_shot eager':>15} {'graph':>8}")
    by = {}
    for r in rows:
        by.setdefault((r["dtype"], r["bytes"]), {})[r["kernel"]] = r
    for (dname, nbytes), ks in by.items():
        cells = []
        for k in ("one_shot", "two_shot"):
            r = ks.get(k, {})
            eager, graph = r.get("eager_us"), r.get("graph_us")
            cells += [f"{eager:15.2f}" if eager is not None else f"{'N/A':>15}",
                      f"{graph:8.2f}" if graph is not None else f"{'N/A':>8}"]
        lines.append(f"{dname:>8} {nbytes:>10} " + " ".join(cells))
    for r in rows:
        for key in ("na", "graph_na"):
            if key in r:
                lines.append(f"N/A {r['kernel']} {r['dtype']} {r['bytes']} ({key}): {r[key]}")
    return lines


def _symm_worker(rank, world, port, args, queue):
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, device_id=torch.device("cuda", rank))
    import torch.distributed._symmetric_memory as symm_mem
    group = dist.group.WORLD.group_name
    floor_us, floor_host_us = _launch_floor(args.iters)
    rows = []
    for dname in args.dtype.split(","):
        dtype = {"float": torch.float32, "bfloat16": torch.bfloat16}[dname]
        esize = torch.tensor([], dtype=dtype).element_size()
        for nbytes in _sizes(args.minbytes, args.maxbytes, args.stepfactor):
            n = max(1, nbytes // esize)
            buf = symm_mem.empty(n, dtype=dtype, device="cuda")
            symm_mem.rendezvous(buf, group)
            out = torch.empty_like(buf)
            gen = torch.Generator(device="cuda").manual_seed(1000 + rank)
            data = torch.randn(n, generator=gen, device="cuda", dtype=torch.float32).to(dtype)
            every = [torch.empty_like(data) for _ in range(world)]
            dist.all_gather(every, data)
            kernels = {
                # (F821: pyflakes reads the `del buf, out` after the loop as coming first)
                "one_shot": lambda: torch.ops.symm_mem.one_shot_all_reduce_out(buf, "sum", group, out),  # noqa: F821
                "two_shot": lambda: torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", group),  # noqa: F821
            }
            for name, fn in kernels.items():
                row = {"kernel": name, "dtype": dname, "bytes": n * esize}
                err = 0.0
                try:
                    buf.copy_(data)
                    fn()
                    torch.cuda.synchronize()
                    got = out if name == "one_shot" else buf
                    err = rounding_error_ratio(got, every, dtype)
                except Exception as e:  # not in this torch, or refused for this size/dtype
                    row["na"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
                    err = -1.0
                # every rank takes the same way out of here (a rank alone in a collective hangs)
                if _max_over_ranks(-err) > 0:
                    row.setdefault("na", "refused on another rank")
                    rows.append(row)
                    continue
                worst = _max_over_ranks(err)
                if worst > 1.0:
                    raise AssertionError(f"{name} {dname} {nbytes} B at {world} ranks: an error "
                                         f"{worst:.2f} times what rounding in {dname} allows")
                row["eager_us"] = _max_over_ranks(_events_us(fn, args.iters))
                row["launch_floor_us"], row["launch_floor_host_us"] = floor_us, floor_host_us
                graph = None
                try:
                    graph = _capture(fn, args.iters)
                except Exception as e:  # the kernel cannot be captured
                    row["graph_na"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
                row["graph_us"] = None
                if _max_over_ranks(0.0 if graph is not None else 1.0) == 0:
                    row["graph_us"] = _max_over_ranks(_events_us(graph.replay, 1) / args.iters)
                rows.append(row)
            del buf, out
    if rank == 0:
        queue.put(rows)
    dist.destroy_process_group()


def _mlp(args):
    """The MLP both step modes train, on the current GPU, from seed 0 (the same on every rank
    and for every backend)."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(64, args.width), torch.nn.ReLU()]
    for _ in range(args.layers - 2):
        layers += [torch.nn.Linear(args.width, args.width), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(args.width, 1))
    return torch.nn.Sequential(*layers).cuda()


def _stepper(model, opt, rank, args):
    """step(i): forward, backward and SGD step of `model` on this rank's i-th batch (8, cycled)."""
    g = torch.Generator(device="cuda").manual_seed(1234 + rank)
    xs = [torch.randn(args.batch, 64, device="cuda", generator=g) for _ in range(8)]
    ys = [x.sum(1, keepdim=True).sin() for x in xs]

    def step(i):
        loss = torch.nn.functional.mse_loss(model(xs[i % 8]), ys[i % 8])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return step


def _ddp_worker(rank, world, port, args, queue):
    import pyccl  # noqa: F401  (registers "pyccl")
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, device_id=torch.device("cuda", rank))
    groups = {"nccl": None, "pyccl": dist.new_group(backend="pyccl")}

    def make(pg):  # the same MLP, from the same seed, for each backend
        model = DDP(_mlp(args), device_ids=[rank], process_group=pg)
        return model, torch.optim.SGD(model.parameters(), lr=1e-3)

    # "floor": a third copy whose steps run under model.no_sync() (no all-reduce: the step no
    # backend can go under), timed between the two backends' loops in every round
    models = {name: make(pg) for name, pg in (*groups.items(), ("floor", None))}

    def stepper(name):
        model, opt = models[name]
        step = _stepper(model, opt, rank, args)
        if name != "floor":
            return step

        def local_step(i):
            with model.no_sync():
                step(i)
        return local_step

    steps = {name: stepper(name) for name in models}
    _time_steps(models, steps, groups, args, rank, queue, lambda model: model.parameters())


def _time_steps(models, steps, groups, args, rank, queue, params):
    """The step loops of the ddp and fsdp modes, in the same processes: 10 warm-up steps each,
    then --rounds rounds (the backends alternating which goes first, the floor between them),
    rank 0's profile with --profile; rank 0 puts the rows (params(model): the parameters after
    training, as full tensors; called on every rank, since gathering them may be collective)."""
    for name in models:
        for i in range(10):
            steps[name](i)
    times = {name: [] for name in models}
    for r in range(args.rounds):  # the backends alternate which goes first
        order = ("nccl", "floor", "pyccl") if r % 2 == 0 else ("pyccl", "floor", "nccl")
        for name in order:
            gpu_s, host_s = _timed_loops(steps[name], args.steps)
            times[name].append((_max_over_ranks(gpu_s * 1e3), _max_over_ranks(host_s * 1e3)))
    tables = {}
    if args.profile:  # where a step's time goes, rank 0's view
        from torch.profiler import ProfilerActivity, profile
        for name in groups:
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for i in range(20):
                    steps[name](i)
                torch.cuda.synchronize()
            tables[name] = prof.key_averages().table(sort_by="self_cpu_time_total",
                                                     row_limit=args.profile)
    finals = {name: torch.cat([p.detach().reshape(-1) for p in params(model)]).cpu()
              for name, (model, _) in models.items()}
    if rank == 0:
        rows = []
        for name in models:
            final = finals[name]
            rows.append({"backend": name, "rounds_ms": [t[0] for t in times[name]],
                         "rounds_host_ms": [t[1] for t in times[name]],
                         "ms_per_step": statistics.median(t[0] for t in times[name]),
                         "host_ms_per_step": statistics.median(t[1] for t in times[name]),
                         "params": final.numel(), "final": final.numpy().tobytes(),
                         "profile": tables.get(name)})
        queue.put(rows)
    dist.destroy_process_group()


def _fsdp_worker(rank, world, port, args, queue):
    import copy

    import pyccl  # noqa: F401  (registers "pyccl")
    from torch.distributed.device_mesh import DeviceMesh
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import fully_shard
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, device_id=torch.device("cuda", rank))
    groups = {"nccl": dist.new_group(backend="nccl"), "pyccl": dist.new_group(backend="pyccl")}
    base = _mlp(args)  # one MLP, copied for each backend and for the floor

    def make(pg):
        # FSDP2 on a mesh of the group: each Linear and the whole model sharded (parameters
        # all-gathered before use, gradients reduce-scattered); pg None: the floor, the same
        # step unsharded with no communication at all
        model = copy.deepcopy(base)
        if pg is not None:
            mesh = DeviceMesh.from_group(pg, "cuda")
            for layer in model:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
        return model, torch.optim.SGD(model.parameters(), lr=1e-3)

    models = {name: make(pg) for name, pg in (*groups.items(), ("floor", None))}

    def full(model):  # DTensor shards gathered (collective on the model's mesh)
        return [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]

    steps = {name: _stepper(*models[name], rank, args) for name in models}
    _time_steps(models, steps, groups, args, rank, queue, full)


def _timeout_worker(rank, world, port, args, queue):
    import pyccl
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, device_id=torch.device("cuda", rank))
    pg = dist.new_group(backend="pyccl")
    uid = [pyccl.unique_id() if rank == 0 else None]
    dist.broadcast_object_list(uid, src=0)
    untimed = pyccl.Communicator(world, uid[0], rank)
    uid2 = [pyccl.unique_id() if rank == 0 else None]
    dist.broadcast_object_list(uid2, src=0)
    timed = pyccl.Communicator(world, uid2[0], rank, timeout=600)
    systems = {
        "untimed auto": lambda t: untimed.all_reduce(t),
        "untimed nccl": lambda t: untimed.all_reduce(t, algo="nccl"),
        "timed auto": lambda t: timed.all_reduce(t),
        "timed nccl": lambda t: timed.all_reduce(t, algo="nccl"),
    }
    blocking = None
    if hasattr(timed, "blocking"):  # a timeout on a blocking handle (the backend's kind)
        uid3 = [pyccl.unique_id() if rank == 0 else None]
        dist.broadcast_object_list(uid3, src=0)
        blocking = pyccl.Communicator(world, uid3[0], rank, timeout=600, blocking=True)
        systems["timed blk auto"] = lambda t: blocking.all_reduce(t)
        systems["timed blk nccl"] = lambda t: blocking.all_reduce(t, algo="nccl")
    systems['dist "pyccl"'] = lambda t: dist.all_reduce(t, group=pg)
    systems['dist "nccl"'] = lambda t: dist.all_reduce(t)
    rows = []
    for nbytes in _sizes(args.minbytes, args.maxbytes, args.stepfactor):
        n = max(1, nbytes // 4)
        t = torch.arange(n, dtype=torch.float32, device="cuda") % 7
        row = {"bytes": nbytes}
        for name, fn in systems.items():
            for _ in range(5):
                fn(t)
            gpu_s, host_s = _timed_loops(lambda _i: fn(t), args.iters)
            row[name] = (gpu_s * 1e6, host_s * 1e6)
        rows.append(row)
    untimed.destroy()
    timed.destroy()
    if blocking is not None:
        blocking.destroy()
    if rank == 0:
        queue.put(rows)
    dist.destroy_process_group()


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(fn, world, *extra, deadline_s=600.0):
    """Rank 0's result of fn on `world` spawned ranks; raises when a rank fails (its traceback)
    or nothing came within deadline_s (every rank is then ended)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = mp.spawn(fn, args=(world, _port()) + extra + (queue,), nprocs=world, join=False)
    end = time.monotonic() + deadline_s
    try:
        while True:  # read before joining: rank 0 may block in put() until this reads
            try:
                result = queue.get(timeout=1.0)
                break
            except Empty:
                if procs.join(timeout=0):  # raises where a rank failed
                    raise RuntimeError("peers_bench: the ranks ended without a result")
                if time.monotonic() > end:
                    raise RuntimeError(f"peers_bench: no result within {deadline_s:.0f} s")
        while not procs.join(timeout=1.0):
            if time.monotonic() > end:
                raise RuntimeError(f"peers_bench: the ranks did not end within {deadline_s:.0f} s")
    finally:
        for p in procs.processes:
            if p.is_alive():
                p.kill()
    return result


def _param_difference(a, b):
    """The largest difference between two trainings' parameters (float32, as bytes), relative
    to the largest parameter: at more than 2 ranks the backends sum in different orders."""
    x = torch.frombuffer(bytearray(a), dtype=torch.float32).double()
    y = torch.frombuffer(bytearray(b), dtype=torch.float32).double()
    return ((x - y).abs().max() / x.abs().max().clamp_min(1e-30)).item()


def main(argv=None):
    p = argparse.ArgumentParser(prog="tools/peers_bench.py", description=__doc__.split("\n")[0])
    p.add_argument("what", choices=("symm", "ddp", "fsdp", "timeout"))
    p.add_argument("-g", "--ngpus", type=int, default=None, help="ranks = GPUs (default: all)")
    p.add_argument("-b", "--minbytes", type=_size, default=8)
    p.add_argument("-e", "--maxbytes", type=_size, default=64 << 20)
    p.add_argument("-f", "--stepfactor", type=int, default=4)
    p.add_argument("-n", "--iters", type=int, default=100)
    p.add_argument("--dtype", default="float,bfloat16")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5,
                   help="ddp, fsdp: rounds of timed loops, the backends alternating which goes first")
    p.add_argument("--profile", type=int, default=0, metavar="ROWS",
                   help="ddp, fsdp: also profile 20 steps per backend and print this many rows of "
                        "rank 0's ops by CPU time")
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args(argv)
    world = args.ngpus or torch.cuda.device_count()
    if world < 2 or world > torch.cuda.device_count():
        sys.exit(f"peers_bench: needs 2 or more GPUs, one per rank (asked {world}, "
                 f"this machine has {torch.cuda.device_count()})")
    for name, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                        ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ.setdefault(name, value)
    if args.what == "timeout":
        rows = _spawn(_timeout_worker, world, args)
        names = [k for k in rows[0] if k != "bytes"]
        print(f"all_reduce float32 sum in place, {world} ranks, rank 0, GPU µs / host µs per call")
        print(f"{'bytes':>10} " + " ".join(f"{k:>15}" for k in names))
        for r in rows:
            print(f"{r['bytes']:>10} " + " ".join(f"{r[k][0]:7.1f}/{r[k][1]:<7.1f}" for k in names))
    elif args.what == "symm":
        rows = _spawn(_symm_worker, world, args)
        print("\n".join(symm_table(rows, world)))
    else:
        fsdp = args.what == "fsdp"
        rows = _spawn(_fsdp_worker if fsdp else _ddp_worker, world, args)
        nccl, pyccl_, floor = rows
        final_n, final_p = nccl.pop("final"), pyccl_.pop("final")
        same = final_n == final_p
        floor.pop("final")
        # two ranks: both backends add the same two numbers; more: they sum in different orders
        print(f"{'FSDP2' if fsdp else 'DDP'} step, {world} ranks, MLP {args.layers} layers of "
              f"{args.width} ({nccl['params']} parameters), batch {args.batch} per rank; both "
              f"backends and the floor in the same processes, {args.rounds} rounds, median over rounds")
        floor_what = ("unsharded, no communication" if fsdp
                      else "without the all-reduce (model.no_sync())")
        for r in rows:
            what = floor_what if r["backend"] == "floor" else f"backend {r['backend']}"
            print(f"  {what + ':':<42} {r['ms_per_step']:.3f} ms per step (host "
                  f"{r['host_ms_per_step']:.3f} ms); rounds: "
                  + " ".join(f"{v:.3f}" for v in r["rounds_ms"]))
        for r in rows:
            table = r.pop("profile")
            if table:
                print(f"profile, backend {r['backend']}, rank 0, 20 steps:\n{table}")
        ratios = [p / n for p, n in zip(pyccl_["rounds_ms"], nccl["rounds_ms"])]
        over = [(p - f) / (n - f) if n > f else float("nan")
                for p, n, f in zip(pyccl_["rounds_ms"], nccl["rounds_ms"], floor["rounds_ms"])]
        print(f"  pyccl / nccl: {pyccl_['ms_per_step'] / nccl['ms_per_step']:.3f} (rounds: "
              + " ".join(f"{v:.3f}" for v in ratios) + "); above the floor, pyccl / nccl: "
              + " ".join(f"{v:.2f}" for v in over)
              + f"; parameters after training bitwise equal: {same}"
              + ("" if same else f" (largest difference {_param_difference(final_n, final_p):.1e} "
                 "of the largest parameter)"))
        if not same and world == 2:
            print("peers_bench: the two backends trained to different parameters")
            return 1
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
