"""Command line of `python -m pyccl.bench`: nccl-tests' flags with nccl-tests' meanings and its
output (the collective, which nccl-tests picks by program name, is --coll), plus --compare
(torch.distributed and torch.cuda.nccl in the same run), --host-overhead, --api and files, and
two modes of pyccl's own all_reduce kernels: --algos (an algo sweep, with --variants of their
settings; eager, CUDA-graph and host time per call) and --host-breakdown (where the host time of
an eager call goes). Every mode prints tables and writes --json/--csv/--plot.
main(argv) returns the exit status: 0; 1 when no GPU is found, any system's run fails (crashes,
hangs past -T/--timeout and is killed, or cannot start; a peer's too, and a last line names every
failed system), or pyccl gives wrong results (a peer's wrong results are only reported); 2 on a
bad command line; 130 when interrupted.
"""
import argparse
import os
import socket
import sys
import time
import traceback
from collections.abc import Sequence
from typing import Any

from . import algos
from . import report
from . import runner
from . import sizes

PEERS = ["torch.distributed", runner.DIST_PYCCL, "torch.cuda.nccl"]
_DESCRIBE = {"pyccl": "per-rank API, one process per GPU",
             "pyccl.nccl": "torch.cuda.nccl drop-in, one process driving every GPU",
             "torch.distributed": "nccl backend, one process per GPU",
             runner.DIST_PYCCL: "pyccl backend, one process per GPU",
             "torch.cuda.nccl": "one process driving every GPU",
             runner.SYMM_SYSTEM: "NCCL all_reduce on pyccl.empty buffers registered as symmetric "
                                 "windows, one process per GPU"}

_EPILOG = """\
Flags are nccl-tests' with nccl-tests' meanings. Each rank is a process of its own with one
thread and one GPU, so -t/--nthreads is 1 and -g/--ngpus is the number of GPUs (= ranks), as in
an nccl-tests run of one process (`all_reduce_perf -g 2`); -p/--parallel_init is always
parallel; -R 2 is --registered; -m/--agg_iters is 1. nccl-tests picks the collective by program
(all_reduce_perf, ...): here it is --coll. Other nccl-tests flags (-C, -N, -y, -J, -M, -S, -x, -D,
-V, -R 1) are refused with a message.

examples:
  python -m pyccl.bench -b 8 -e 128M -f 2 -g 2                 all_reduce sweep on 2 GPUs
  python -m pyccl.bench -b 8 -e 128M -f 2 --algo nccl --registered   NCCL on plain vs window memory
  python -m pyccl.bench --coll all -b 1K -e 1G -f 4 --compare --json out.json --plot out.png
  python -m pyccl.bench -b 8 -e 256K -f 8 -G 10                 captured in a CUDA graph
  python -m pyccl.bench --host-overhead                          CPU us per call, 4 systems
  python -m pyccl.bench -b 8 -e 16M -f 4 -n 100 --algos all --variants PYCCL_AR_PDL=0
                                                    own kernels vs NCCL, eager/graph/host
  python -m pyccl.bench --host-breakdown                         where an eager call's host time goes
"""


# what --no-nvls sets: NCCL's NVLink SHARP (NVLS) algorithms, torch's symmetric-memory
# multicast and NVSHMEM's NVLS off
_NO_NVLS = (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
           ("NVSHMEM_DISABLE_NVLS", "1"))


def _nvls_line(environ=None):
    """The header line saying what the environment sets for NVLink SHARP / multicast."""
    environ = os.environ if environ is None else environ
    names = [k for k, _ in _NO_NVLS]
    if not any(k in environ for k in names):
        return f"# NVLS/multicast: NCCL default ({', '.join(names)} unset)"
    return "# NVLS/multicast: " + " ".join(
        f"{k}={environ[k]}" if k in environ else f"{k} unset" for k in names)


def _typed(fn, what):
    def parse(text):
        try:
            return fn(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    parse.__name__ = what
    return parse


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of `python -m pyccl.bench` (its --help is the flag reference)."""
    p = argparse.ArgumentParser(
        prog="python -m pyccl.bench", epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="nccl-tests style benchmark of pyccl, optionally side by side with "
                    "torch.distributed and torch.cuda.nccl.")
    a = p.add_argument
    a("--coll", type=_typed(sizes.parse_colls, "coll"), default=["all_reduce"],
      help=f"collective(s), comma separated: {', '.join(sizes.COLLS)} or all (default all_reduce; "
           "nccl-tests: the program's name)")
    a("-t", "--nthreads", type=_typed(_nthreads, "nthreads"), default=1,
      help="threads per process: 1 (each rank is a process of its own)")
    size = lambda what: _typed(lambda t: sizes.parse_size(t, what), what)  # noqa: E731
    a("-b", "--minbytes", type=size("minbytes"), default=32 << 20,
      help="smallest size, bytes with optional K/M/G suffix (default 32M)")
    a("-e", "--maxbytes", type=size("maxbytes"), default=32 << 20,
      help="largest size (default 32M)")
    a("-i", "--stepbytes", type=size("stepbytes"), default=1 << 20,
      help="size increment when -f is not > 1 (default 1M)")
    a("-f", "--stepfactor", type=int, default=1, help="size multiplication factor (default 1: off)")
    a("-g", "--ngpus", type=int, default=None,
      help="GPUs = ranks, one process each (default: every visible GPU); nccl-tests' GPUs per "
           "thread, with its one thread")
    a("-o", "--op", type=_typed(sizes.parse_ops, "op"), default=["sum"],
      help="reduction op(s): sum, prod, max, min, avg or all (default sum)")
    a("-d", "--datatype", type=_typed(sizes.parse_dtypes, "datatype"), default=["float"],
      help=f"data type(s): {', '.join(sizes.DTYPES)}, nccl-tests/NCCL names, "
           "or all (default float)")
    a("-r", "--root", type=int, default=0, help="root of broadcast and reduce (default 0)")
    a("-n", "--iters", type=int, default=20, help="iterations per timed loop (default 20)")
    a("-w", "--warmup_iters", type=int, default=5, help="untimed warm-up iterations (default 5)")
    a("-m", "--agg_iters", type=_typed(_one_agg, "agg_iters"), default=1,
      help="operations aggregated in one group: 1 (pyccl.bench times single calls)")
    a("-p", "--parallel_init", type=int, choices=(0, 1), default=0,
      help="0/1: initialise NCCL from threads in parallel; ranks are processes, so always parallel")
    a("-c", "--check", type=int, default=1,
      help="verification runs per size, counting wrong elements; 0 = off (default 1)")
    a("-G", "--cudagraph", type=int, default=0,
      help="capture the iterations in a CUDA graph and replay it N times (default 0: eager)")
    a("-z", "--blocking", type=int, default=0,
      help="1: synchronize and barrier after every collective (default 0)")
    a("-a", "--average", type=int, choices=(0, 1, 2, 3), default=1,
      help="time across ranks: 0 rank 0, 1 average, 2 minimum, 3 maximum (default 1)")
    a("-R", "--local_register", type=int, choices=(0, 1, 2), default=0,
      help="2: --registered (symmetric windows); 0: off (default); 1 (local registration) is "
           "not measured")
    for short, long in _REFUSED:
        a(short, "--" + long, default=None, help=argparse.SUPPRESS)
    a("-T", "--timeout", type=float, default=300.0,
      help="seconds without progress before the run is killed (default 300; process "
           "start-up, importing torch, gets at least 60)")
    a("--repeats", type=int, default=5, help="timed loops per size; the median is reported (default 5)")
    a("--api", choices=("comm", "nccl"), default="comm",
      help="pyccl API: comm = per-rank Communicator (default), nccl = torch.cuda.nccl drop-in")
    a("--algo", choices=algos.ALGOS, default=None,
      help="pyccl all_reduce algorithm (per-rank API): auto = pyccl's own kernels where they "
           "win, else NCCL (default auto); all_gather and reduce_scatter take oneshot (pyccl's "
           "kernel; auto and nccl are NCCL's there)")
    a("--compare", action="store_true",
      help="also run torch.distributed (on nccl and on pyccl) and torch.cuda.nccl and print "
           "pyccl/peer ratios")
    a("--registered", action="store_true",
      help="also run nccl-symm: NCCL's all_reduce (algo=nccl) on pyccl.empty buffers registered "
           "as symmetric windows (NCCL >= 2.27; other collectives read N/A), and print "
           "pyccl/nccl-symm ratios")
    a("--host-overhead", action="store_true",
      help="instead of the sweep: CPU and GPU us per 1-element all_reduce call, four systems")
    a("--host-iters", type=int, default=None,
      help="calls per loop for --host-overhead (default 2000) and --host-breakdown (default 400)")
    a("--algos", type=_typed(_parse_algos, "algos"), default=None,
      help="instead of the sweep: all_reduce float sum in place with each of these algos "
           f"({', '.join(algos.ALGOS)} or all), eager, CUDA graph and host CPU time per call, on "
           "pyccl's per-rank API; -n calls per loop up to 1M, a tenth above; the launch floor (an "
           "empty kernel launched as the own kernels are) printed above the host table; then 100 "
           "small tensors, a call each against all_reduce_coalesced")
    a("--variants", nargs="+", metavar="NAME=VALUE", default=[],
      help="with --algos: also measure the own kernels (oneshot, twoshot) on a sub-communicator "
           "set up with this environment variable, one per variant (e.g. PYCCL_AR_PDL=0 "
           "PYCCL_AR_BLOCKS=32; commas separate too)")
    a("--host-breakdown", action="store_true",
      help="instead of the sweep: host and GPU us per eager call, from a Python no-op and raw "
           "ctypes launches up to the 8-byte all_reduce (own kernel with and without PDL, NCCL), "
           "and what timeout= adds (the same calls on timed communicators, blocking and "
           "non-blocking, and each CUDA call and host step a timed call adds, timed in C: "
           "host time only)")
    a("--json", metavar="FILE", help="write configuration and results as JSON")
    a("--csv", metavar="FILE", help="write results as CSV, one row per result (sweep: per size "
                                    "and placement; --algos: per size, algo and timing)")
    a("--plot", metavar="FILE.png", help="plot time and busbw against size; --algos: time per "
                                         "call per timing; --host-breakdown: bars (needs matplotlib)")
    a("--no-nvls", action="store_true",
      help="NVLink SHARP and multicast off for this run and its processes: sets "
           + ", ".join(f"{k}={v}" for k, v in _NO_NVLS) + " (default: the environment's "
           "values, NCCL's defaults where unset; the header says which)")
    a("--no-progress", action="store_true", help="no progress line on stderr")
    return p


# nccl-tests flags pyccl.bench has no counterpart for: taken, then refused with a message
_REFUSED = (("-C", "report_cputime"), ("-N", "run_cycles"), ("-y", "stream_null"),
            ("-J", "output_file"), ("-M", "memory"), ("-S", "report_timestamps"),
            ("-x", "cta_policy"), ("-D", "device_implementation"), ("-V", "device_cta_count"))


def _nthreads(text):
    try:
        n = int(text, 0)
    except ValueError:
        raise ValueError(f"{text!r} is not a thread count (nccl-tests' -t; the collective is "
                         "--coll)") from None
    if n != 1:
        raise ValueError(f"{n}: each rank is a process of its own with one thread; use -g for "
                         "the number of GPUs")
    return n


def _one_agg(text):
    try:
        n = int(text, 0)
    except ValueError:
        raise ValueError(f"{text!r} is not a count") from None
    if n != 1:
        raise ValueError(f"{n}: pyccl.bench times single calls, not groups of them (1 only)")
    return n


def _parse_algos(text):
    names = [t.strip() for t in text.split(",") if t.strip()]
    if names == ["all"]:
        return list(algos.ALGOS)
    for t in names:
        if t not in algos.ALGOS:
            raise ValueError(f"unknown algo {t!r}: choose from {', '.join(algos.ALGOS)} or all")
    if not names:
        raise ValueError(f"empty algo list {text!r}")
    return list(dict.fromkeys(names))


def _variants(args):
    out = [v for text in args.variants for v in text.split(",") if v]
    for v in out:
        name, eq, _ = v.partition("=")
        if not eq or not name:
            raise ValueError(f"--variants: {v!r} is not NAME=VALUE")
    if out and args.algos is None:
        raise ValueError("--variants needs --algos (it repeats the own-kernel columns)")
    if out and not any(a in algos.OWN for a in args.algos):
        raise ValueError("--variants measures the own kernels: --algos must include oneshot "
                         "or twoshot")
    return out


def _mode(args):
    modes = [flag for flag, on in (("--algos", args.algos is not None),
                                   ("--host-overhead", args.host_overhead),
                                   ("--host-breakdown", args.host_breakdown)) if on]
    if len(modes) > 1:
        raise ValueError(f"{' and '.join(modes)} are separate modes: give one")
    if not modes or modes[0] == "--host-overhead":
        return "host" if modes else "sweep", None
    flag = modes[0]
    if args.api != "comm":
        raise ValueError(f"{flag} measures pyccl's per-rank API: --api {args.api} does not apply")
    if args.compare:
        raise ValueError(f"{flag} cannot be combined with --compare (NCCL runs on the same "
                         "communicator, algo='nccl')")
    if args.algo is not None:
        raise ValueError(f"{flag} cannot be combined with --algo"
                         + (" (--algos lists every algo to measure)" if flag == "--algos" else ""))
    if args.cudagraph:
        raise ValueError(f"-G/--cudagraph does not apply to {flag}"
                         + (" (it times eager and CUDA-graph calls both)" if flag == "--algos" else ""))
    if args.blocking:
        raise ValueError(f"-z/--blocking does not apply to {flag}")
    if flag == "--algos" and (args.coll != ["all_reduce"] or args.datatype != ["float"]
                              or args.op != ["sum"]):
        raise ValueError("--algos measures all_reduce float sum in place: --coll, "
                         "-d/--datatype and -o/--op do not apply")
    return ("algos" if flag == "--algos" else "breakdown"), flag


def make_config(args: argparse.Namespace) -> dict[str, Any]:
    """Validated plain-dict configuration handed to the runner (and to child processes)."""
    for short, long in _REFUSED:
        if getattr(args, long) is not None:
            raise ValueError(f"{short}/--{long} (nccl-tests) is not supported by pyccl.bench")
    if args.local_register == 1:
        raise ValueError("-R/--local_register 1 (local registration) is not measured by pyccl.bench; "
                         "-R 2 is --registered (symmetric windows)")
    if args.local_register == 2:
        args.registered = True
    mode, flag = _mode(args)
    variants = _variants(args)
    if args.host_iters is None:
        args.host_iters = 400 if mode == "breakdown" else 2000
    for name, low in (("iters", 1), ("warmup_iters", 0), ("check", 0), ("cudagraph", 0),
                      ("blocking", 0), ("repeats", 1), ("host_iters", 1), ("root", 0)):
        if getattr(args, name) < low:
            raise ValueError(f"--{name} must be >= {low}, got {getattr(args, name)}")
    if args.registered and (mode != "sweep" or args.api != "comm"):
        raise ValueError("--registered adds a system to the sweep of pyccl's per-rank API "
                         "(not with --api nccl, --algos, --host-overhead or --host-breakdown)")
    if args.ngpus is not None and args.ngpus < 1:
        raise ValueError(f"--ngpus must be >= 1, got {args.ngpus}")
    if args.timeout <= 0:
        raise ValueError(f"--timeout must be > 0, got {args.timeout}")
    byte_sizes = sizes.size_list(args.minbytes, args.maxbytes, args.stepbytes, args.stepfactor)
    if mode == "algos" and byte_sizes[0] < 4:
        raise ValueError(f"--algos: sizes start at 4 bytes (one float), got -b {byte_sizes[0]}")
    return {"mode": mode, "colls": args.coll,
            "dtypes": args.datatype, "ops": args.op, "root": args.root, "sizes": byte_sizes,
            "minbytes": args.minbytes, "maxbytes": args.maxbytes, "stepbytes": args.stepbytes,
            "stepfactor": args.stepfactor, "iters": args.iters, "warmup": args.warmup_iters,
            "repeats": args.repeats, "check": args.check, "graph": args.cudagraph,
            "blocking": bool(args.blocking), "average": args.average, "timeout": args.timeout,
            "host_iters": args.host_iters, "algo": args.algo or "auto",
            "algos": args.algos, "variants": variants}


def _tqdm():
    """tqdm's bar class where tqdm is installed (an optional dependency), else None."""
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm


class _Progress:
    """On a terminal, a progress bar per system (tqdm, where installed; else one self-overwriting
    line); otherwise a line at most every 10 s, and always the first and last of each system (so a
    log shows which system a hang is in)."""

    def __init__(self, enabled, stream=None):
        stream = stream or sys.stderr
        self.stream, self.enabled = stream, enabled
        self.tty, self.last, self.shown, self.system = stream.isatty(), 0.0, False, None
        self.bar_type = _tqdm() if enabled and self.tty else None
        self.bar = None

    def __call__(self, system, done, total, what):
        if not self.enabled:
            return
        if self.bar_type is not None:
            self._bar(system, done, total, what)
            return
        line = f"[pyccl.bench] {system}: {done}/{total} {what}"
        now = time.monotonic()
        if self.tty:
            self.stream.write("\r\033[K" + line[:150])
            self.shown = True
        elif now - self.last >= 10.0 or done == total or system != self.system:
            self.stream.write(line + "\n")
            self.last = now
        self.system = system
        self.stream.flush()

    def _bar(self, system, done, total, what):
        if self.bar is None or system != self.system or self.bar.total != total:
            self._close()
            self.bar = self.bar_type(total=total, desc=f"[pyccl.bench] {system}", file=self.stream,
                                     leave=False, dynamic_ncols=True, unit="step")
        self.system = system
        self.bar.set_postfix_str(what, refresh=False)
        self.bar.n = done  # a call per size or phase: drawn every time
        self.bar.refresh()
        if done >= total:
            self._close()

    def _close(self):
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def clear(self):
        if self.bar is not None:
            self.bar.clear()  # the next update draws it again, below what was printed
        if self.shown:
            self.stream.write("\r\033[K")
            self.stream.flush()
            self.shown = False


class _Printer:
    """nccl-tests' stdout: parameters, devices, one table per collective, closing summary."""

    def __init__(self, cfg, out, progress):
        self.cfg, self.out, self.progress, self.coll = cfg, out, progress, None

    def emit(self, text):
        self.progress.clear()
        print(text, file=self.out, flush=True)

    def start(self, system, nranks):
        c, self.coll = self.cfg, None
        step = (c["stepfactor"], "factor") if c["stepfactor"] > 1 else (c["stepbytes"], "bytes")
        ngpus = nranks if system in runner.SINGLE else 1
        lines = [f"# pyccl.bench: {system} ({_DESCRIBE[system]}), {nranks} ranks"
                 + (f", all_reduce algo={c.get('algo', 'auto')}" if system == "pyccl" else ""),
                 "# nThread 1 nGpus %d minBytes %d maxBytes %d step: %d(%s) warmup iters: %d "
                 "iters: %d agg iters: 1 validation: %d graph: %d" % (
                     ngpus, c["minbytes"], c["maxbytes"], step[0], step[1], c["warmup"],
                     c["iters"], c["check"], c["graph"]),
                 f"# time: CUDA events, median of {c['repeats']} loops, "
                 f"{report.AVERAGE_MODES[c['average']]} over ranks"]
        if c["blocking"]:
            lines.append("# Blocking Enabled: wait for completion and barrier after each collective")
        if c["graph"] and system in runner.SINGLE:
            lines.append(f"# -G/--cudagraph is not supported by {system}: its columns read N/A")
        self.emit("\n".join(lines + ["#"]))

    def info(self, lines):
        self.emit("\n".join(["# Using devices"] + lines + ["#"]))

    def row(self, oop, ip):
        if oop.coll != self.coll:
            self.coll = oop.coll
            self.emit(f"# Collective: {oop.coll}\n" + report.format_header())
        self.emit(report.format_row(oop, ip))

    def end(self, results):
        self.emit(report.format_summary(results))


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark with command-line arguments `argv` (default: sys.argv[1:]); returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        cfg = make_config(args)
    except ValueError as e:
        parser.error(str(e))
    if args.no_nvls:  # before anything loads NCCL; the spawned processes inherit it
        os.environ.update(_NO_NVLS)
    os.environ["PYCCL_BENCH_ALGO"] = cfg["algo"]  # read by the spawned pyccl processes
    avail = runner.cuda_device_count()
    if avail == 0:
        print("pyccl.bench: no CUDA GPU found", file=sys.stderr)
        return 1
    n = args.ngpus or avail
    # one process per rank can share GPUs (pyccl.place_rank): correct, but not a speed figure;
    # a system that drives every rank from one process needs a GPU per rank
    single = args.api == "nccl" or (args.compare and cfg["mode"] == "sweep") or cfg["mode"] == "host"
    if n > avail and single:
        print(f"pyccl.bench: -g/--ngpus {n} asks for more GPUs than the {avail} visible",
              file=sys.stderr)
        return 1
    if n > avail:
        print(f"# {n} ranks share {avail} GPU(s): results are checked, but times are not "
              f"those of {n} GPUs", flush=True)
    if cfg["root"] >= n and sizes.ROOTED.intersection(cfg["colls"]):
        print(f"pyccl.bench: -r/--root {cfg['root']} is not a rank of {n} GPUs (0..{n - 1})",
              file=sys.stderr)
        return 1
    primary = "pyccl" if args.api == "comm" else "pyccl.nccl"
    progress = _Progress(not args.no_progress)
    printer = _Printer(cfg, sys.stdout, progress)
    printer.emit(_nvls_line())
    if cfg["mode"] in ("algos", "breakdown"):
        argv = sys.argv[1:] if argv is None else argv
        return _own_kernels(args, cfg, n, progress, printer, "python -m pyccl.bench " + " ".join(argv))
    status, results, host, failed = 0, [], [], []
    if cfg["mode"] == "host":
        systems = ["pyccl", "pyccl.nccl"] + PEERS
    else:
        systems = [primary] + (PEERS if args.compare else [])
    peers = (PEERS if args.compare else []) + ([runner.SYMM_SYSTEM] if args.registered else [])
    if args.registered and cfg["mode"] == "sweep":
        systems.append(runner.SYMM_SYSTEM)
    for system in systems:
        try:
            if cfg["mode"] == "host":
                progress(system, 0, 1, "host overhead")
                host.append(runner.run_host_overhead(system, n, cfg))
                progress(system, 1, 1, "host overhead")
                continue
            printer.start(system, n)
            got = runner.run_sweep(system, n, cfg, printer.info, printer.row, progress)
            printer.end(got)
            results += got
        except KeyboardInterrupt:  # the runner has killed the children already
            progress.clear()
            print(f"pyccl.bench: interrupted during {system}", file=sys.stderr)
            return 130
        except Exception as e:  # BenchError, or anything else: the next system still runs
            progress.clear()
            text = str(e) if isinstance(e, runner.BenchError) else \
                f"{system}: unexpected error in the parent:\n{traceback.format_exc().rstrip()}"
            print(f"pyccl.bench: error: {text}", file=sys.stderr, flush=True)
            failed.append(system)
    if host:
        printer.emit(report.format_host(host, cfg["host_iters"], cfg["repeats"]))
    if peers and results:
        comparison = report.compare(results, primary, peers)
        printer.emit(report.format_comparison(comparison, primary, peers))
    if any(r.wrong for r in results if r.system == primary):
        print(f"pyccl.bench: {primary} produced wrong results (see #wrong)", file=sys.stderr)
        status = 1
    status = max(status, _write_files(args, cfg, n, systems, results, host))
    if failed:  # last, so it is not lost above the tables
        print(f"pyccl.bench: FAILED: {len(failed)} of {len(systems)} systems did not complete: "
              f"{', '.join(failed)} (errors above); exit status 1", file=sys.stderr, flush=True)
        status = 1
    return status


def _own_kernels(args, cfg, n, progress, printer, command):
    """--algos and --host-breakdown: pyccl's per-rank API, one table, the same files."""
    what = "--algos" if cfg["mode"] == "algos" else "--host-breakdown"
    algo_results, breakdown = [], []
    try:
        progress("pyccl", 0, 1, what)
        if cfg["mode"] == "algos":
            algo_results, info = runner.run_algos(n, cfg, progress)
            text = report.format_algos(algo_results, cfg["algos"], cfg["variants"], cfg["sizes"],
                                       n, info, command, cfg["repeats"])
        else:
            import torch
            breakdown, info = runner.run_breakdown(n, cfg)
            text = report.format_breakdown(breakdown, n, cfg["host_iters"], cfg["repeats"], info,
                                           command, torch.__version__)
    except KeyboardInterrupt:
        progress.clear()
        print(f"pyccl.bench: interrupted during {what}", file=sys.stderr)
        return 130
    except Exception as e:
        progress.clear()
        text = str(e) if isinstance(e, runner.BenchError) else \
            f"pyccl: unexpected error in the parent:\n{traceback.format_exc().rstrip()}"
        print(f"pyccl.bench: error: {text}", file=sys.stderr, flush=True)
        print(f"pyccl.bench: FAILED: {what} did not complete (errors above); exit status 1",
              file=sys.stderr, flush=True)
        return 1
    if n < 2:
        text = ("# 1 rank: pyccl's own kernels need 2 to 8 ranks; their rows and columns are "
                "left out (auto is NCCL here)\n" + text)
    printer.emit(text)
    cfg = dict(cfg, all_reduce_info=info)
    return _write_files(args, cfg, n, ["pyccl"], [], [], algo_results, breakdown)


def _write_files(args, cfg, n, systems, results, host, algo_results=(), breakdown=()):
    status = 0
    if args.json:
        import torch
        config = dict(cfg, ngpus=n, systems=systems, api=args.api, torch=torch.__version__,
                      hostname=socket.gethostname(),
                      nvls={k: os.environ.get(k) for k, _ in _NO_NVLS})
        report.write_json(args.json, config, results, host, algo_results, breakdown)
    records = results or host or algo_results or breakdown
    if args.csv and records:
        report.write_csv(args.csv, records)
    if args.plot:
        plot = (report.write_plot, results) if results else \
            (report.write_algo_plot, algo_results) if algo_results else \
            (report.write_breakdown_plot, breakdown) if breakdown else None
        if plot is None:
            print("pyccl.bench: --plot: no sweep results to plot", file=sys.stderr)
        else:
            try:
                plot[0](args.plot, plot[1])
            except ImportError:
                print("pyccl.bench: --plot needs matplotlib (pip install matplotlib)",
                      file=sys.stderr)
                status = 1
    return status
