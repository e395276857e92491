"""Results of the benchmark and every way they are shown: nccl-tests tables, the comparison
table with pyccl/peer ratios, the host-overhead table, the --algos and --host-breakdown tables,
JSON, CSV and the PNG plot.

Everything here is pure (no CUDA); the runner hands in per-rank timings and wrong counts.
"""
import csv
import dataclasses
import json
import math
import os
import statistics
import typing
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, overload

from . import sizes
from .algos import HOST_BURST

PLACEMENTS = ("out-of-place", "in-place")
AVERAGE_MODES = {0: "rank 0", 1: "average", 2: "minimum", 3: "maximum"}


@dataclass
class Result:
    """One (system, collective, dtype, op, size, placement) measurement; None means N/A."""
    system: str
    coll: str
    dtype: str
    op: str
    root: int
    size: int
    count: int
    nranks: int
    placement: str
    time_us: typing.Optional[float] = None
    algbw: typing.Optional[float] = None
    busbw: typing.Optional[float] = None
    wrong: typing.Optional[int] = None


@dataclass
class HostResult:
    """Host CPU and GPU microseconds per all_reduce call on a 1-element tensor."""
    system: str
    nranks: int
    calls: int
    host_us: float
    gpu_us: float


@dataclass
class AlgoResult:
    """--algos: microseconds per all_reduce call (float32 sum in place) of one algo at one size.
    timing: eager, graph, host (CPU time of the eager loop), or for the many-small-tensors
    step (size = the bytes of all tensors together) per-tensor loop or coalesced, per step, or
    launch floor (size 0, algo "empty kernel": host us per launch of an empty kernel with the
    own kernels' parameter block, launched as they are, from C).
    variant: NAME=VALUE the sub-communicator was set up under, None for the defaults."""
    system: str
    nranks: int
    size: int
    algo: str
    variant: typing.Optional[str]
    timing: str
    iters: int
    time_us: float


@dataclass
class BreakdownResult:
    """--host-breakdown: host CPU and GPU microseconds per call of one case (maximum over ranks of
    each rank's median over loops)."""
    case: str
    nranks: int
    calls: int
    host_us: float
    gpu_us: float


# one record of any kind, as write_csv/read_csv take them
_Record = Result | HostResult | AlgoResult | BreakdownResult
_R = TypeVar("_R", Result, HostResult, AlgoResult, BreakdownResult)
_Path = typing.Union[str, "os.PathLike[str]"]
_P = TypeVar("_P", bound=_Path)


def aggregate_times(per_rank: Sequence[Sequence[float]], mode: int = 3) -> float:
    """per_rank[r][loop] seconds -> one time: per loop across ranks (nccl-tests -a: 0 rank 0,
    1 average, 2 min, 3 max), then the median over loops."""
    if not per_rank or not per_rank[0]:
        raise ValueError("aggregate_times: no timings")
    if mode not in AVERAGE_MODES:
        raise ValueError(f"aggregate_times: average mode {mode} is not one of 0, 1, 2, 3")
    loops = list(zip(*per_rank))
    pick = {0: lambda xs: xs[0], 1: lambda xs: sum(xs) / len(xs), 2: min, 3: max}[mode]
    return statistics.median(pick(list(xs)) for xs in loops)


def make_result(system: str, coll: str, dtype: str, op: str, root: int, size: int, nranks: int,
                placement: str, per_rank: Sequence[Sequence[float]] | None = None,
                wrongs: Sequence[int | None] | None = None, mode: int = 3) -> Result:
    """Result from raw per-rank timings (seconds per iteration, per loop); None timings = N/A."""
    elsize = sizes.elem_size(dtype)
    c = sizes.coll_counts(coll, size, elsize, nranks)
    r = Result(system, coll, dtype, op, sizes.root_for(coll, root),
               max(c.sendcount, c.recvcount) * elsize, c.count, nranks, placement)
    if per_rank is not None:
        sec = aggregate_times(per_rank, mode)
        r.time_us = sec * 1e6
        r.algbw, r.busbw = sizes.bandwidths(coll, c.count, elsize, nranks, sec)
        if wrongs is not None and all(w is not None for w in wrongs):
            r.wrong = int(sum(w for w in wrongs if w is not None))
    return r


# ---- nccl-tests text format -------------------------------------------------------------------

def format_time(us: float | None) -> str:
    """nccl-tests' time column: fewer decimals as the time grows, always 7 wide."""
    if us is None:
        return "%7s" % "N/A"
    if us >= 10000.0:
        return "%7.0f" % us
    if us >= 100.0:
        return "%7.1f" % us
    return "%7.2f" % us


def format_header(time_name: str = "time") -> str:
    sp = ("",) * 5
    return "\n".join([
        "# %10s  %12s  %8s  %6s  %6s           out-of-place                       in-place          " % sp,
        "# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s %6s  %7s  %6s  %6s %6s" % (
            "size", "count", "type", "redop", "root", time_name, "algbw", "busbw", "#wrong",
            time_name, "algbw", "busbw", "#wrong"),
        "# %10s  %12s  %8s  %6s  %6s  %7s  %6s  %6s  %5s  %7s  %6s  %6s  %5s" % (
            "(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)",
            "(GB/s)", ""),
    ])


def _half(r: Result | None) -> str:
    if r is None or r.time_us is None:
        return "  %7s  %6s  %6s  %5s" % ("N/A", "N/A", "N/A", "N/A")
    wrong = "N/A" if r.wrong is None else str(r.wrong)
    return "  %7s  %6.2f  %6.2f  %5s" % (format_time(r.time_us), r.algbw, r.busbw, wrong)


def format_row(oop: Result | None, ip: Result | None) -> str:
    """One nccl-tests line from the out-of-place and in-place results of one size."""
    r = oop if oop is not None else ip
    return "%12d  %12d  %8s  %6s  %6d" % (r.size, r.count, r.dtype, r.op, r.root) + \
        _half(oop) + _half(ip)


def format_summary(results: Sequence[Result]) -> str:
    """nccl-tests' closing lines: sizes with wrong elements and the mean of every busbw shown."""
    errors = sum(1 for r in results if r.wrong)
    bws = [r.busbw for r in results if r.busbw is not None]
    avg = sum(bws) / len(bws) if bws else 0.0
    return "# Out of bounds values : %d %s\n# Avg bus bandwidth    : %g \n#" % (
        errors, "FAILED" if errors else "OK", avg)


def format_host(results: Iterable[HostResult], calls: int, repeats: int) -> str:
    lines = [f"# Host overhead: all_reduce (sum) of one float element; {calls} calls per loop, "
             f"median of {repeats} loops, maximum over ranks",
             "# %23s  %6s  %15s  %15s" % ("system", "ranks", "host (us/call)", "gpu (us/call)")]
    for h in results:
        lines.append("  %23s  %6d  %15.2f  %15.2f" % (h.system, h.nranks, h.host_us, h.gpu_us))
    return "\n".join(lines)


def _cell(v: float | None, w: int) -> str:
    return f"{v:{w}.2f}" if v is not None else f"{'-':>{w}}"


def format_algos(results: Sequence[AlgoResult], algos: Sequence[str], variants: Sequence[str],
                 sizes: Iterable[int], nranks: int, info: object, command: str, repeats: int = 5,
                 ntensors: int = 100) -> str:
    """The --algos tables: many small tensors, then eager, CUDA graph and host, a row per size,
    a column per algo (then per own algo and variant)."""
    t = {(r.size, r.algo, r.variant, r.timing): r.time_us for r in results}
    lines = []
    steps = [r for r in results if r.timing in ("per-tensor loop", "coalesced")]
    if steps:
        nb = steps[0].size
        lines.append(f"# {ntensors} float32 tensors of 256..32K elements ({nb} bytes), "
                     "us per step (all of them once): per-tensor loop vs all_reduce_coalesced")
        for algo in ("auto", "nccl"):
            lo, co = t.get((nb, algo, None, "per-tensor loop")), t.get((nb, algo, None, "coalesced"))
            if lo is not None and co is not None:
                lines.append(f"#   algo={algo:5}: loop {lo:9.1f}   coalesced {co:8.1f}   "
                             f"({lo / co:.1f}x)")
    lines.append(f"# all_reduce float32 sum in place, {nranks} ranks, us per call (median of "
                 f"{repeats} loops of the max over ranks); own kernels: {info}")
    lines.append(f"# command: {command}")
    own = [a for a in algos if a in ("oneshot", "twoshot")]
    extra = [(v, a) for v in variants for a in own]
    for timing in ("eager", "graph", "host"):
        lines.append("\n## " + {"eager": "eager", "graph": "CUDA graph",
                                "host": "eager, host CPU time per call (enqueue only; eager is "
                                        "host-bound where this is close to it)"}[timing])
        ratio = "nccl" in algos and own
        head = f"{'bytes':>10} " + " ".join(f"{a:>9}" for a in algos)
        if ratio:
            head += "  best-own/nccl" if timing != "host" else "  nccl/own host"
        head += "".join(f" {a[:3]}@{v.replace('PYCCL_AR_', '')}" for v, a in extra)
        floor = t.get((0, "empty kernel", None, "launch floor"))
        if timing == "host" and floor is not None:
            lines.append(f"# launch floor: {floor:.2f} us per launch (an empty kernel with the own "
                         "kernels' parameter block, launched as they are, from C)")
        lines.append(head)
        for size in sizes:
            row = {a: t.get((size, a, None, timing)) for a in algos}
            line = f"{size:>10} " + " ".join(_cell(row[a], 9) for a in algos)
            if ratio:
                mine = [row[a] for a in own if row[a] is not None]
                nccl = row["nccl"]
                line += "  " + (f"{nccl / min(mine):13.2f}x" if mine and nccl else f"{'-':>14}")
            for v, a in extra:
                line += " " + _cell(t.get((size, a, v, timing)), 5 + len(v.replace("PYCCL_AR_", "")))
            lines.append(line)
    return "\n".join(lines)


def format_breakdown(results: Iterable[BreakdownResult], nranks: int, calls: int, repeats: int, info: object,
                     command: str, torch_version: str = "?") -> str:
    lines = [f"# eager host cost per call, {nranks} ranks, {calls} calls a loop, median of "
             f"{repeats}, max over ranks; torch {torch_version}, pyccl own kernels: {info}",
             f"# host: the first {min(calls, HOST_BURST)} calls after a sync (the launch queue never "
             f"full); gpu: the whole loop; 'in C:' rows: host only, {calls} calls in C",
             f"# command: {command}",
             f"{'':45} {'host us':>8} {'gpu us':>8}"]
    for b in results:
        gpu = "-" if math.isnan(b.gpu_us) else f"{b.gpu_us:.2f}"  # nan: timed in C, host only
        lines.append(f"{b.case:45} {b.host_us:8.2f} {gpu:>8}")
    return "\n".join(lines)


# ---- comparison -------------------------------------------------------------------------------

SHORT = {"pyccl": "pyccl", "pyccl.nccl": "pyccl.nccl", "torch.distributed": "dist",
         "torch.distributed:pyccl": "dist:pyccl",
         "torch.cuda.nccl": "t.c.nccl"}


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None when either is missing or b is zero."""
    if a is None or b is None or b == 0:
        return None
    return a / b


@dataclass
class CompareRow:
    coll: str
    dtype: str
    op: str
    size: int
    placement: str
    time_us: dict[str, float | None]  # system -> time
    busbw: dict[str, float | None]  # system -> busbw
    time_ratio: dict[str, float | None]  # peer -> primary time / peer time (< 1: primary faster)
    busbw_ratio: dict[str, float | None]  # peer -> primary busbw / peer busbw (> 1: primary faster)


def compare(results: Sequence[Result], primary: str, peers: Sequence[str]) -> list[CompareRow]:
    """Side-by-side rows, one per (coll, dtype, op, size, placement) the primary measured."""
    by_key = {(r.system, r.coll, r.dtype, r.op, r.size, r.placement): r for r in results}
    rows = []
    for r in results:
        if r.system != primary:
            continue
        key = (r.coll, r.dtype, r.op, r.size, r.placement)
        peer = {p: by_key.get((p,) + key) for p in peers}
        t = {primary: r.time_us, **{p: (x.time_us if x else None) for p, x in peer.items()}}
        b = {primary: r.busbw, **{p: (x.busbw if x else None) for p, x in peer.items()}}
        rows.append(CompareRow(*key, t, b, {p: ratio(t[primary], t[p]) for p in peers},
                               {p: ratio(b[primary], b[p]) for p in peers}))
    return rows


def _num(x: float | None, fmt: str = "%10.2f") -> str:
    return "%10s" % "N/A" if x is None else fmt % x


def format_comparison(rows: Iterable[CompareRow], primary: str, peers: Sequence[str]) -> str:
    systems = [primary, *peers]
    names = [SHORT.get(x, x) for x in systems]
    block = " ".join("%10s" % c for c in names + ["/" + x for x in names[1:]])
    prefix = "%14s  %10s  %8s  %6s  %8s  | %s | %s"
    head = "#%13s" + prefix[4:]
    lines = [f"# Comparison: ratio columns are {names[0]} / peer (time ratio < 1 and busbw "
             f"ratio > 1 mean {names[0]} is faster); N/A: the system has no such call",
             head % ("", "", "", "", "", "time (us)".center(len(block)),
                     "busbw (GB/s)".center(len(block))),
             head % ("coll", "size", "type", "redop", "in-place", block, block)]
    for row in rows:
        t = [_num(row.time_us[x]) for x in systems] + [_num(row.time_ratio[p], "%10.3f") for p in peers]
        b = [_num(row.busbw[x]) for x in systems] + [_num(row.busbw_ratio[p], "%10.3f") for p in peers]
        lines.append(prefix % (row.coll, row.size, row.dtype, row.op,
                               "yes" if row.placement == "in-place" else "no", " ".join(t), " ".join(b)))
    return "\n".join(lines)


# ---- files ------------------------------------------------------------------------------------

def write_json(path: _Path, config: Mapping[str, Any], results: Iterable[Result], host: Iterable[HostResult] = (),
               algos: Iterable[AlgoResult] = (), breakdown: Iterable[BreakdownResult] = ()) -> None:
    """Every mode writes one document: config, results (the sweep), host_overhead, algos and
    host_breakdown (each a list, empty where that mode did not run)."""
    doc = {"pyccl_bench": 1, "config": config,
           "results": [dataclasses.asdict(r) for r in results],
           "host_overhead": [dataclasses.asdict(h) for h in host],
           "algos": [dataclasses.asdict(a) for a in algos],
           "host_breakdown": [dataclasses.asdict(b) for b in breakdown]}
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)


def read_json(path: _Path) -> tuple[dict[str, Any], list[Result], list[HostResult]]:
    """-> (config, [Result], [HostResult]); read_json_all for the --algos and --host-breakdown
    lists too."""
    config, results, host, _, _ = read_json_all(path)
    return config, results, host


def read_json_all(path: _Path) -> tuple[dict[str, Any], list[Result], list[HostResult], list[AlgoResult],
                                       list[BreakdownResult]]:
    """-> (config, [Result], [HostResult], [AlgoResult], [BreakdownResult])"""
    with open(path) as f:
        doc = json.load(f)
    return (doc["config"], [Result(**r) for r in doc["results"]],
            [HostResult(**h) for h in doc.get("host_overhead", [])],
            [AlgoResult(**a) for a in doc.get("algos", [])],
            [BreakdownResult(**b) for b in doc.get("host_breakdown", [])])


def write_csv(path: _Path, records: Sequence[_Record]) -> None:
    """One row per dataclass record (Result or HostResult); N/A is an empty field."""
    if not records:
        raise ValueError(f"write_csv: nothing to write to {path}")
    names = [f.name for f in dataclasses.fields(records[0])]
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(names)
        for rec in records:
            w.writerow(["" if v is None else repr(v) if isinstance(v, float) else v
                        for v in dataclasses.astuple(rec)])


@overload
def read_csv(path: _Path) -> list[Result]: ...
@overload
def read_csv(path: _Path, cls: type[_R]) -> list[_R]: ...
def read_csv(path: _Path, cls: type[_Record] = Result) -> list[Any]:
    """The records write_csv wrote, as `cls` (Result unless told)."""
    hints = typing.get_type_hints(cls)
    out = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            vals = {}
            for name, text in row.items():
                args = typing.get_args(hints[name])
                typ = next(a for a in args if a is not type(None)) if args else hints[name]
                vals[name] = None if text == "" and args else typ(text)
            out.append(cls(**vals))
    return out


def write_plot(path: _P, results: Iterable[Result]) -> _P:
    """Latency and busbw against size, one line per system (and per coll/dtype/op if several);
    solid out-of-place, dashed in-place. matplotlib is imported here, with the Agg backend."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    combos = {(r.coll, r.dtype, r.op) for r in results}
    series = {}
    for r in results:
        if r.time_us is None or r.size == 0:  # no point at size 0 on a log axis
            continue
        label = r.system if len(combos) == 1 else f"{r.system} {r.coll} {r.dtype} {r.op}"
        series.setdefault((label, r.placement), []).append(r)
    fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(13, 5))
    labels = sorted({label for label, _ in series})
    colors = {label: f"C{i % 10}" for i, label in enumerate(labels)}  # one colour per system
    for (label, placement), rs in sorted(series.items()):
        rs.sort(key=lambda r: r.size)
        xs = [r.size for r in rs]
        kw = {"color": colors[label], "marker": ".", "label": f"{label} ({placement})",
              "linestyle": "-" if placement == "out-of-place" else "--"}
        ax_t.plot(xs, [r.time_us for r in rs], **kw)
        ax_b.plot(xs, [r.busbw for r in rs], **kw)
    for ax, ylabel in ((ax_t, "time per call (us)"), (ax_b, "bus bandwidth (GB/s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("size (bytes)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    ax_t.set_yscale("log")
    ax_t.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax_t.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    if series:
        ax_b.legend(fontsize="small")
    title = ", ".join(sorted(" ".join(c) for c in combos))
    fig.suptitle(f"pyccl.bench: {title}" if title else "pyccl.bench")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_algo_plot(path: _P, results: Iterable[AlgoResult]) -> _P:
    """--algos: time per call against size, one panel per timing (eager, CUDA graph, host), one
    line per algo (and variant)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timings = ("eager", "graph", "host")
    fig, axes = plt.subplots(1, 3, figsize=(16, 5), sharey=True)
    for ax, timing in zip(axes, timings):
        series = {}
        for r in results:
            if r.timing == timing:
                label = r.algo if r.variant is None else f"{r.algo} @{r.variant}"
                series.setdefault(label, []).append(r)
        for i, (label, rs) in enumerate(sorted(series.items())):
            rs.sort(key=lambda r: r.size)
            ax.plot([r.size for r in rs], [r.time_us for r in rs], marker=".", color=f"C{i % 10}",
                    label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title({"eager": "eager", "graph": "CUDA graph", "host": "host CPU, eager"}[timing])
        ax.set_xlabel("size (bytes)")
        ax.grid(True, which="both", alpha=0.3)
        if series:
            ax.legend(fontsize="small")
    axes[0].set_ylabel("time per call (us)")
    fig.suptitle("pyccl.bench --algos: all_reduce float32 sum in place")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_breakdown_plot(path: _P, results: Sequence[BreakdownResult]) -> _P:
    """--host-breakdown: host and GPU microseconds per call, one pair of bars per case."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 0.45 * len(results) + 1.5))
    ys = range(len(results))
    ax.barh([y - 0.2 for y in ys], [b.host_us for b in results], height=0.4, label="host")
    ax.barh([y + 0.2 for y in ys], [b.gpu_us for b in results], height=0.4, label="GPU")
    ax.set_yticks(list(ys))
    ax.set_yticklabels([b.case for b in results], fontsize="small")
    ax.invert_yaxis()
    ax.set_xlabel("us per call")
    ax.legend()
    ax.grid(True, axis="x", alpha=0.3)
    fig.suptitle("pyccl.bench --host-breakdown: where an eager call's host time goes")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
