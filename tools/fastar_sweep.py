"""All-reduce latency of pyccl's own kernels against NCCL, eager and CUDA-graph, one run.

    python tools/fastar_sweep.py [-g NGPUS] [-b 8] [-e 16M] [-f 4] [--variants PYCCL_AR_BLOCKS=32,...] [--json FILE]

One process per GPU.  For each size (x f steps, float32 sum, in place) and algo (nccl, oneshot,
twoshot, auto): eager = CUDA events around `iters` back-to-back calls / iters; graph = `iters`
calls captured in one CUDA graph, replayed, / iters.  Each figure is the median of 5 loops of
the maximum over ranks.  NCCL runs on the same communicator (algo='nccl'), so the columns are
side by side from one run.  --variants repeats the own-kernel columns under other settings (PYCCL_AR_BLOCKS,
PYCCL_AR_LL_MAX, ...; a fresh communicator each) to find the best.
"""
import argparse
import json
import os
import statistics
import sys
import time

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
               ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_k, _v)

import torch

from _spawn import run_ranks

ALGOS = ["nccl", "oneshot", "twoshot", "auto"]


def _parse_size(s):
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(s[:-1]) * mult[s[-1].upper()] if s[-1].upper() in mult else int(s)


def _time(comm, fn, iters, graph, host=None):
    """us per call on this rank, 5 loops; with a list `host`, also the host time per call of
    each loop (the calls only enqueue work: iters is far below the launch queue's depth)."""
    dev = comm.device
    if graph:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize(dev)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(iters):
                fn()
        run = g.replay
    else:
        def run():
            for _ in range(iters):
                fn()
    run()  # warm-up
    out = []
    for _ in range(5):
        comm.barrier()
        torch.cuda.synchronize(dev)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        h = time.perf_counter()
        run()
        h = time.perf_counter() - h
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) * 1000.0 / iters)
        if host is not None:
            host.append(h * 1e6 / iters)
    return out


def _rank(rank, world, uid, cfg):
    import pyccl
    torch.cuda.set_device(rank)
    comm = pyccl.Communicator(world, uid, rank)
    res = {}
    variants = [(None, comm)]
    comm.all_reduce(torch.ones(4, device=f"cuda:{rank}"), algo="oneshot")  # set up: default grid
    for b in cfg["blocks"]:
        name, _, val = b.partition("=")
        old = os.environ.get(name)
        os.environ[name] = val  # read at a communicator's set-up
        sub = comm.split(0)
        sub.all_reduce(torch.ones(4, device=f"cuda:{rank}"), algo="oneshot")
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old
        variants.append((b, sub))
    for size in cfg["sizes"]:
        x = torch.randn(size // 4, device=f"cuda:{rank}")
        for blocks, c in variants:
            for algo in (ALGOS if blocks is None else ["oneshot", "twoshot"]):
                if algo in ("oneshot", "twoshot") and size > c.all_reduce_info["buffer_bytes"]:
                    continue
                for graph in (False, True):
                    iters = cfg["iters"] if size <= (1 << 20) else max(5, cfg["iters"] // 10)
                    host = [] if not graph else None
                    # auto is the default: called as users call it, without algo=
                    fn = (lambda: c.all_reduce(x)) if algo == "auto" else (lambda: c.all_reduce(x, algo=algo))
                    t = _time(c, fn, iters, graph, host)
                    res[(size, algo, blocks, graph)] = t
                    if host is not None:
                        res[(size, algo, blocks, "host")] = host
    # many small gradients: one coalesced call against a call per tensor
    grads = [torch.randn(n, device=f"cuda:{rank}") for n in cfg["grads"]]
    for algo in ("auto", "nccl"):
        def loop():
            for g_ in grads:
                comm.all_reduce(g_, algo=algo)
        res[("loop", algo)] = _time(comm, loop, 5, False)
        res[("coalesced", algo)] = _time(comm, lambda: comm.all_reduce_coalesced(grads, algo=algo), 5, False)
    info = comm.all_reduce_info
    for _, c in variants:
        c.destroy()
    return res, info


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-g", "--ngpus", type=int, default=torch.cuda.device_count())
    p.add_argument("-b", "--minbytes", default="8")
    p.add_argument("-e", "--maxbytes", default="16M")
    p.add_argument("-f", "--stepfactor", type=int, default=4, help="size multiplier between rows")
    p.add_argument("-n", "--iters", type=int, default=100)
    p.add_argument("--variants", default="",
                   help="comma list of NAME=VALUE settings (e.g. PYCCL_AR_BLOCKS=32) whose own-kernel "
                        "columns are measured as well, each on a fresh communicator")
    p.add_argument("--json")
    args = p.parse_args()
    if args.ngpus < 2:
        sys.exit("fastar_sweep: needs 2 GPUs or more")
    if args.stepfactor < 2:
        sys.exit(f"fastar_sweep: -f must be 2 or more, got {args.stepfactor}")
    sizes, s = [], _parse_size(args.minbytes)
    while s <= _parse_size(args.maxbytes):
        sizes.append(max(4, s))
        s *= args.stepfactor
    cfg = {"sizes": sizes, "iters": args.iters,
           "grads": [(1 << (8 + k % 8)) + k for k in range(100)],
           "blocks": [b for b in args.variants.split(",") if b]}
    import pyccl
    uid = pyccl.unique_id()
    got = run_ranks("fastar_sweep", _rank, args.ngpus, uid, cfg, timeout=500)
    info = got[0][1]
    keys = got[0][0].keys()
    # max over ranks per loop, then the median of the loops
    t = {k: statistics.median(max(got[r][0][k][i] for r in got) for i in range(5)) for k in keys}
    nb = sum(cfg["grads"]) * 4
    print(f"# {len(cfg['grads'])} float32 tensors of 256..32K elements ({nb} bytes), us per step "
          f"(all of them once): per-tensor loop vs all_reduce_coalesced")
    for algo in ("auto", "nccl"):
        lo, co = t.pop(("loop", algo)), t.pop(("coalesced", algo))
        print(f"#   algo={algo:5}: loop {lo:9.1f}   coalesced {co:8.1f}   ({lo / co:.1f}x)")
    print(f"# all_reduce float32 sum in place, {args.ngpus} ranks, us per call "
          f"(median of 5 loops of the max over ranks); own kernels: {info}")
    print(f"# command: python tools/fastar_sweep.py -g {args.ngpus} -b {args.minbytes} "
          f"-e {args.maxbytes} -f {args.stepfactor} -n {args.iters}" + (f" --variants {args.variants}" if args.variants else ""))
    for graph in (False, True, "host"):
        print("\n## " + {False: "eager", True: "CUDA graph",
                         "host": "eager, host CPU time per call (enqueue only; eager is host-bound "
                                 "where this is close to it)"}[graph])
        head = f"{'bytes':>10} " + " ".join(f"{a:>9}" for a in ALGOS) + "  best-own/nccl"
        if graph == "host":
            head = head.replace("best-own/nccl", "nccl/own host")
        extra = [(b, a) for b in cfg["blocks"] for a in ("oneshot", "twoshot")]
        head += "".join(f" {a[:3]}@{b.replace('PYCCL_AR_', '')}" for b, a in extra)
        print(head)
        for size in sizes:
            row = [t.get((size, a, None, graph)) for a in ALGOS]
            own = [v for v in row[1:3] if v is not None]
            ratio = f"{row[0] / min(own):13.2f}x" if own else f"{'-':>14}"
            line = f"{size:>10} " + " ".join(f"{v:9.2f}" if v is not None else f"{'-':>9}" for v in row)
            line += "  " + ratio
            for b, a in extra:
                v = t.get((size, a, b, graph))
                w = 5 + len(b.replace("PYCCL_AR_", ""))
                line += f" {v:{w}.2f}" if v is not None else f" {'-':>{w}}"
            print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ngpus": args.ngpus, "info": info,
                       "rows": [{"bytes": k[0], "algo": k[1], "blocks": k[2], "graph": k[3] is True,
                                 "what": "host" if k[3] == "host" else "gpu", "us": v}
                                for k, v in t.items()]}, f, indent=1)


if __name__ == "__main__":
    main()
