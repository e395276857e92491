"""Results of the benchmark and every way they are shown: nccl-tests tables, the comparison
table with pyccl/peer ratios, the host-overhead table, JSON, CSV and the PNG plot.

Everything here is pure (no CUDA); the runner hands in per-rank timings and wrong counts.
"""
import csv
import dataclasses
import json
import statistics
import typing
from dataclasses import dataclass

from . import sizes as S

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


def aggregate_times(per_rank, mode=3):
    """per_rank[r][loop] seconds -> one time: per loop across ranks (nccl-tests -a: 0 rank 0,
    1 average, 2 min, 3 max), then the median over loops."""
    if not per_rank or not per_rank[0]:
        raise ValueError("aggregate_times: no timings")
    if mode not in AVERAGE_MODES:
        raise ValueError(f"aggregate_times: average mode {mode} is not one of 0, 1, 2, 3")
    loops = list(zip(*per_rank))
    pick = {0: lambda xs: xs[0], 1: lambda xs: sum(xs) / len(xs), 2: min, 3: max}[mode]
    return statistics.median(pick(list(xs)) for xs in loops)


def make_result(system, coll, dtype, op, root, size, nranks, placement, per_rank=None,
                wrongs=None, mode=3):
    """Result from raw per-rank timings (seconds per iteration, per loop); None timings = N/A."""
    elsize = S.elem_size(dtype)
    c = S.coll_counts(coll, size, elsize, nranks)
    r = Result(system, coll, dtype, op, S.root_for(coll, root),
               max(c.sendcount, c.recvcount) * elsize, c.count, nranks, placement)
    if per_rank is not None:
        sec = aggregate_times(per_rank, mode)
        r.time_us = sec * 1e6
        r.algbw, r.busbw = S.bandwidths(coll, c.count, elsize, nranks, sec)
        if wrongs is not None and all(w is not None for w in wrongs):
            r.wrong = int(sum(wrongs))
    return r


# ---- nccl-tests text format -------------------------------------------------------------------

def format_time(us):
    """nccl-tests' time column: fewer decimals as the time grows, always 7 wide."""
    if us is None:
        return "%7s" % "N/A"
    if us >= 10000.0:
        return "%7.0f" % us
    if us >= 100.0:
        return "%7.1f" % us
    return "%7.2f" % us


def format_header(time_name="time"):
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


def _half(r):
    if r is None or r.time_us is None:
        return "  %7s  %6s  %6s  %5s" % ("N/A", "N/A", "N/A", "N/A")
    wrong = "N/A" if r.wrong is None else str(r.wrong)
    return "  %7s  %6.2f  %6.2f  %5s" % (format_time(r.time_us), r.algbw, r.busbw, wrong)


def format_row(oop, ip):
    """One nccl-tests line from the out-of-place and in-place results of one size."""
    r = oop if oop is not None else ip
    return "%12d  %12d  %8s  %6s  %6d" % (r.size, r.count, r.dtype, r.op, r.root) + \
        _half(oop) + _half(ip)


def format_summary(results):
    """nccl-tests' closing lines: sizes with wrong elements and the mean of every busbw shown."""
    errors = sum(1 for r in results if r.wrong)
    bws = [r.busbw for r in results if r.busbw is not None]
    avg = sum(bws) / len(bws) if bws else 0.0
    return "# Out of bounds values : %d %s\n# Avg bus bandwidth    : %g \n#" % (
        errors, "FAILED" if errors else "OK", avg)


def format_host(results, calls, repeats):
    lines = [f"# Host overhead: all_reduce (sum) of one float element; {calls} calls per loop, "
             f"median of {repeats} loops, maximum over ranks",
             "# %18s  %6s  %15s  %15s" % ("system", "ranks", "host (us/call)", "gpu (us/call)")]
    for h in results:
        lines.append("  %18s  %6d  %15.2f  %15.2f" % (h.system, h.nranks, h.host_us, h.gpu_us))
    return "\n".join(lines)


# ---- comparison -------------------------------------------------------------------------------

SHORT = {"pyccl": "pyccl", "pyccl.nccl": "pyccl.nccl", "torch.distributed": "dist",
         "torch.cuda.nccl": "t.c.nccl"}


def ratio(a, b):
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
    time_us: dict
    busbw: dict
    time_ratio: dict  # peer -> primary time / peer time (< 1: primary faster)
    busbw_ratio: dict  # peer -> primary busbw / peer busbw (> 1: primary faster)


def compare(results, primary, peers):
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


def _num(x, fmt="%10.2f"):
    return "%10s" % "N/A" if x is None else fmt % x


def format_comparison(rows, primary, peers):
    systems = [primary] + peers
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

def write_json(path, config, results, host=()):
    doc = {"pyccl_bench": 1, "config": config,
           "results": [dataclasses.asdict(r) for r in results],
           "host_overhead": [dataclasses.asdict(h) for h in host]}
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)


def read_json(path):
    """-> (config, [Result], [HostResult])"""
    with open(path) as f:
        doc = json.load(f)
    return (doc["config"], [Result(**r) for r in doc["results"]],
            [HostResult(**h) for h in doc.get("host_overhead", [])])


def write_csv(path, records):
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


def read_csv(path, cls=Result):
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


def write_plot(path, results):
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
