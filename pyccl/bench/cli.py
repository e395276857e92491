"""Command line of `python -m pyccl.bench`: nccl-tests' flags and output, plus --compare
(torch.distributed and torch.cuda.nccl in the same run), --host-overhead, --api and files.
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

from . import report as R
from . import runner
from . import sizes as S

PEERS = ["torch.distributed", "torch.cuda.nccl"]
_DESCRIBE = {"pyccl": "per-rank API, one process per GPU",
             "pyccl.nccl": "torch.cuda.nccl drop-in, one process driving every GPU",
             "torch.distributed": "nccl backend, one process per GPU",
             "torch.cuda.nccl": "one process driving every GPU"}

_EPILOG = """\
examples:
  python -m pyccl.bench -b 8 -e 128M -f 2 -g 2                 all_reduce sweep on 2 GPUs
  python -m pyccl.bench -t all -b 1K -e 1G -f 4 --compare --json out.json --plot out.png
  python -m pyccl.bench -b 8 -e 256K -f 8 -G 10                 captured in a CUDA graph
  python -m pyccl.bench --host-overhead                          CPU us per call, 4 systems
"""


def _typed(fn, what):
    def parse(text):
        try:
            return fn(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    parse.__name__ = what
    return parse


def build_parser():
    p = argparse.ArgumentParser(
        prog="python -m pyccl.bench", epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="nccl-tests style benchmark of pyccl, optionally side by side with "
                    "torch.distributed and torch.cuda.nccl.")
    a = p.add_argument
    a("-t", "--coll", type=_typed(S.parse_colls, "coll"), default=["all_reduce"],
      help=f"collective(s), comma separated: {', '.join(S.COLLS)} or all (default all_reduce)")
    size = lambda what: _typed(lambda t: S.parse_size(t, what), what)  # noqa: E731
    a("-b", "--minbytes", type=size("minbytes"), default=32 << 20,
      help="smallest size, bytes with optional K/M/G suffix (default 32M)")
    a("-e", "--maxbytes", type=size("maxbytes"), default=32 << 20,
      help="largest size (default 32M)")
    a("-i", "--stepbytes", type=size("stepbytes"), default=1 << 20,
      help="size increment when -f is not > 1 (default 1M)")
    a("-f", "--stepfactor", type=int, default=1, help="size multiplication factor (default 1: off)")
    a("-g", "--ngpus", type=int, default=None,
      help="GPUs = ranks, one process each (default: every visible GPU)")
    a("-o", "--op", type=_typed(S.parse_ops, "op"), default=["sum"],
      help="reduction op(s): sum, prod, max, min, avg or all (default sum)")
    a("-d", "--datatype", type=_typed(S.parse_dtypes, "datatype"), default=["float"],
      help=f"data type(s): {', '.join(S.DTYPES)}, nccl-tests/NCCL names, or all (default float)")
    a("-r", "--root", type=int, default=0, help="root of broadcast and reduce (default 0)")
    a("-n", "--iters", type=int, default=20, help="iterations per timed loop (default 20)")
    a("-w", "--warmup_iters", type=int, default=5, help="untimed warm-up iterations (default 5)")
    a("-c", "--check", type=int, default=1,
      help="verification runs per size, counting wrong elements; 0 = off (default 1)")
    a("-G", "--cudagraph", type=int, default=0,
      help="capture the iterations in a CUDA graph and replay it N times (default 0: eager)")
    a("-z", "--blocking", type=int, default=0,
      help="1: synchronize and barrier after every collective (default 0)")
    a("-a", "--average", type=int, choices=(0, 1, 2, 3), default=3,
      help="time across ranks: 0 rank 0, 1 average, 2 minimum, 3 maximum (default 3)")
    a("-T", "--timeout", type=float, default=300.0,
      help="seconds without progress before the run is killed (default 300; process "
           "start-up, importing torch, gets at least 60)")
    a("--repeats", type=int, default=5, help="timed loops per size; the median is reported (default 5)")
    a("--api", choices=("comm", "nccl"), default="comm",
      help="pyccl API: comm = per-rank Communicator (default), nccl = torch.cuda.nccl drop-in")
    a("--algo", choices=("auto", "nccl", "oneshot", "twoshot"), default="auto",
      help="pyccl all_reduce algorithm (per-rank API): auto = pyccl's own kernels where they "
           "win, else NCCL (default auto)")
    a("--compare", action="store_true",
      help="also run torch.distributed and torch.cuda.nccl and print pyccl/peer ratios")
    a("--host-overhead", action="store_true",
      help="instead of the sweep: CPU and GPU us per 1-element all_reduce call, four systems")
    a("--host-iters", type=int, default=2000, help="calls per loop for --host-overhead (default 2000)")
    a("--json", metavar="FILE", help="write configuration and results as JSON")
    a("--csv", metavar="FILE", help="write results as CSV, one row per size and placement")
    a("--plot", metavar="FILE.png", help="plot time and busbw against size (needs matplotlib)")
    a("--no-progress", action="store_true", help="no progress line on stderr")
    return p


def make_config(args):
    """Validated plain-dict configuration handed to the runner (and to child processes)."""
    for name, low in (("iters", 1), ("warmup_iters", 0), ("check", 0), ("cudagraph", 0),
                      ("blocking", 0), ("repeats", 1), ("host_iters", 1), ("root", 0)):
        if getattr(args, name) < low:
            raise ValueError(f"--{name} must be >= {low}, got {getattr(args, name)}")
    if args.ngpus is not None and args.ngpus < 1:
        raise ValueError(f"--ngpus must be >= 1, got {args.ngpus}")
    if args.timeout <= 0:
        raise ValueError(f"--timeout must be > 0, got {args.timeout}")
    sizes = S.size_list(args.minbytes, args.maxbytes, args.stepbytes, args.stepfactor)
    return {"mode": "host" if args.host_overhead else "sweep", "colls": args.coll,
            "dtypes": args.datatype, "ops": args.op, "root": args.root, "sizes": sizes,
            "minbytes": args.minbytes, "maxbytes": args.maxbytes, "stepbytes": args.stepbytes,
            "stepfactor": args.stepfactor, "iters": args.iters, "warmup": args.warmup_iters,
            "repeats": args.repeats, "check": args.check, "graph": args.cudagraph,
            "blocking": bool(args.blocking), "average": args.average, "timeout": args.timeout,
            "host_iters": args.host_iters, "algo": args.algo}


class _Progress:
    """One self-overwriting line on a terminal; otherwise a line at most every 10 s, and always
    the first and last of each system (so a log shows which system a hang is in)."""

    def __init__(self, enabled, stream=None):
        stream = stream or sys.stderr
        self.stream, self.enabled = stream, enabled
        self.tty, self.last, self.shown, self.system = stream.isatty(), 0.0, False, None

    def __call__(self, system, done, total, what):
        if not self.enabled:
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

    def clear(self):
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
                 f"{R.AVERAGE_MODES[c['average']]} over ranks"]
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
            self.emit(f"# Collective: {oop.coll}\n" + R.format_header())
        self.emit(R.format_row(oop, ip))

    def end(self, results):
        self.emit(R.format_summary(results))


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        cfg = make_config(args)
    except ValueError as e:
        parser.error(str(e))
    os.environ["PYCCL_BENCH_ALGO"] = args.algo  # read by the spawned pyccl processes
    avail = runner.cuda_device_count()
    if avail == 0:
        print("pyccl.bench: no CUDA GPU found", file=sys.stderr)
        return 1
    n = args.ngpus or avail
    if n > avail:
        print(f"pyccl.bench: -g/--ngpus {n} asks for more GPUs than the {avail} visible",
              file=sys.stderr)
        return 1
    if cfg["root"] >= n and S.ROOTED.intersection(cfg["colls"]):
        print(f"pyccl.bench: -r/--root {cfg['root']} is not a rank of {n} GPUs (0..{n - 1})",
              file=sys.stderr)
        return 1
    primary = "pyccl" if args.api == "comm" else "pyccl.nccl"
    progress = _Progress(not args.no_progress)
    printer = _Printer(cfg, sys.stdout, progress)
    status, results, host, failed = 0, [], [], []
    if cfg["mode"] == "host":
        systems = ["pyccl", "pyccl.nccl"] + PEERS
    else:
        systems = [primary] + (PEERS if args.compare else [])
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
        printer.emit(R.format_host(host, cfg["host_iters"], cfg["repeats"]))
    if args.compare and results:
        printer.emit(R.format_comparison(R.compare(results, primary, PEERS), primary, PEERS))
    if any(r.wrong for r in results if r.system == primary):
        print(f"pyccl.bench: {primary} produced wrong results (see #wrong)", file=sys.stderr)
        status = 1
    status = max(status, _write_files(args, cfg, n, systems, results, host))
    if failed:  # last, so it is not lost above the tables
        print(f"pyccl.bench: FAILED: {len(failed)} of {len(systems)} systems did not complete: "
              f"{', '.join(failed)} (errors above); exit status 1", file=sys.stderr, flush=True)
        status = 1
    return status


def _write_files(args, cfg, n, systems, results, host):
    status = 0
    if args.json:
        import torch
        config = dict(cfg, ngpus=n, systems=systems, api=args.api, torch=torch.__version__,
                      hostname=socket.gethostname())
        R.write_json(args.json, config, results, host)
    if args.csv and (results or host):
        R.write_csv(args.csv, results or host)
    if args.plot:
        if not results:
            print("pyccl.bench: --plot: no sweep results to plot", file=sys.stderr)
        else:
            try:
                R.write_plot(args.plot, results)
            except ImportError:
                print("pyccl.bench: --plot needs matplotlib (pip install matplotlib)",
                      file=sys.stderr)
                status = 1
    return status
