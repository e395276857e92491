"""The tables of docs/PERFORMANCE.md from the files of one tools/sweep.sh run.

Usage: python tools/sweep_tables.py OUT
  OUT: the sweep's folder ($OUT); where it holds r2, r3, ... (sweep.sh --ranks), one set of
  tables per rank count.  Prints Markdown: all_reduce float32 sum in place, eager and replayed
  from a CUDA graph, then bfloat16 eager, then all_gather and reduce_scatter, µs per call, every
  system the run measured side by side, a row per size, "—" where a system has no figure at that
  size; a file the run did not write (a step left out) leaves its columns out.

Where each column comes from (the files sweep.sh writes):
  algos.json   pyccl auto, own one-shot, own two-shot and NCCL through pyccl (algo="nccl"):
               eager, graph and auto's host µs per call (python -m pyccl.bench --algos);
               algos-large.json the same from 64 MiB to 1 GiB (rows of their own)
  cmp.json     NCCL symmetric (pyccl windows), dist "nccl", dist "pyccl", torch.cuda.nccl
               and, for bfloat16, pyccl auto (--compare --registered; in place)
  cmpg.json    NCCL symmetric in a graph of 10 calls (-G 10 --registered)
  symm.json    torch's symmetric-memory one_shot and two_shot, eager and graph
  nt.txt       nccl-tests (one process, every GPU): eager, -G 10, -R 2 (symmetric), in place;
               its float 64 MiB-1 GiB section beside algos-large's rows
  nt-mpi.txt   nccl-tests built with MPI, one process per GPU, the same three
  coll.json    all_gather and reduce_scatter, every system of --compare (in place);
               coll-own.json pyccl's own kernels for them (--algo oneshot), "pyccl oneshot"
"""
import json
import os
import re
import sys

DASH = "—"


def human(n):
    """8 -> '8', 2048 -> '2 K', 8 << 20 -> '8 M' (as the tables of docs/PERFORMANCE.md)."""
    for unit, name in ((1 << 30, "G"), (1 << 20, "M"), (1 << 10, "K")):
        if n >= unit and n % unit == 0:
            return f"{n // unit} {name}"
    return str(n)


def _load(path):
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def read_nccl_tests(path):
    """{section title: {bytes: in-place µs}} of an nccl-tests output file whose sections start
    with '### TITLE' lines (as sweep.sh writes nt.txt and nt-mpi.txt)."""
    out, title = {}, None
    if not os.path.isfile(path):
        return out
    with open(path) as f:
        for line in f:
            if line.startswith("### "):
                title = line[4:].strip()
                out[title] = {}
                continue
            fields = line.split()
            # size count type redop root | time algbw busbw #wrong (out of place) | the same in place
            if title is not None and len(fields) >= 13 and fields[0].isdigit():
                try:
                    out[title][int(fields[0])] = float(fields[9])
                except ValueError:
                    pass  # N/A
    return out


class Sweep:
    """The figures of one rank count's folder, by column."""

    def __init__(self, folder):
        self.folder = folder
        self.algos = _load(os.path.join(folder, "algos.json"))
        large = _load(os.path.join(folder, "algos-large.json"))
        if large is not None:
            if self.algos is None:
                self.algos = large
            else:
                self.algos["algos"] = self.algos.get("algos", []) + large.get("algos", [])
        self.cmp = _load(os.path.join(folder, "cmp.json"))
        self.cmpg = _load(os.path.join(folder, "cmpg.json"))
        self.symm = _load(os.path.join(folder, "symm.json"))
        self.coll = _load(os.path.join(folder, "coll.json"))
        own = _load(os.path.join(folder, "coll-own.json"))
        if own is not None:
            rows = [dict(r, system="pyccl oneshot") for r in own.get("results", []) if r["system"] == "pyccl"]
            self.coll = {**(self.coll or {}), "results": (self.coll or {}).get("results", []) + rows}
        self.nt = read_nccl_tests(os.path.join(folder, "nt.txt"))
        self.ntm = read_nccl_tests(os.path.join(folder, "nt-mpi.txt"))

    def ranks(self):
        for doc in (self.algos, self.cmp, self.cmpg, self.coll):
            for key in ("algos", "results"):
                for r in (doc or {}).get(key, []):
                    return r["nranks"]
        m = re.search(r"r(\d+)$", os.path.basename(os.path.normpath(self.folder)))
        return int(m.group(1)) if m else None

    def algo(self, algo, timing):
        if self.algos is None:
            return None
        return {r["size"]: r["time_us"] for r in self.algos["algos"]
                if r["algo"] == algo and r["timing"] == timing and r["variant"] is None}

    @staticmethod
    def _results(doc, system, dtype, coll="all_reduce"):
        if doc is None:
            return None
        got = {r["size"]: r["time_us"] for r in doc["results"]
               if r["system"] == system and r["dtype"] == dtype and r["coll"] == coll
               and r["placement"] == "in-place" and r["time_us"] is not None}
        return got or None

    def compared(self, system, dtype):
        return self._results(self.cmp, system, dtype)

    def graphed(self, system, dtype):
        return self._results(self.cmpg, system, dtype)

    def torch_symm(self, kernel, dtype, timing):
        if self.symm is None:
            return None
        got = {r["bytes"]: r[f"{timing}_us"] for r in self.symm
               if r["kernel"] == kernel and r["dtype"] == dtype and r.get(f"{timing}_us") is not None}
        return got or None

    def nccl_tests(self, title, mpi=False):
        got = (self.ntm if mpi else self.nt).get(title)
        if title == "nccl-tests float eager" and not mpi and "nccl-tests float 1G" in self.nt:
            got = {**(got or {}), **self.nt["nccl-tests float 1G"]}  # 64 MiB-1 GiB, eager too
        return got


def table(columns, sizes=None):
    """Markdown: a row per size (the sizes any column has, or `sizes`), a column per (name,
    {bytes: µs}) whose figures exist."""
    columns = [(name, col) for name, col in columns if col]
    if not columns:
        return []
    every = sorted(sizes) if sizes else sorted({s for _, col in columns for s in col})
    lines = ["| bytes | " + " | ".join(name for name, _ in columns) + " |",
             "|---:|" + "---:|" * len(columns)]
    for s in every:
        cells = [f"{col[s]:.1f}" if s in col else DASH for _, col in columns]
        if any(c != DASH for c in cells):  # a size no column has (64 MiB-1 GiB in bfloat16): no row
            lines.append(f"| {human(s)} | " + " | ".join(cells) + " |")
    return lines


def tables(sw):
    """Every table of one rank count, as Markdown lines: a row per size of the --algos run where
    there is one (the sizes every all_reduce step shares), else per size any column has."""
    n = sw.ranks()
    out = [f"## {n} ranks" if n else f"## {sw.folder}"]
    sizes = sorted(sw.algo("auto", "eager") or {}) or None

    def eager_peers(dtype):
        """The eager columns of every system beside pyccl's own, in one dtype."""
        return [
            ("NCCL symmetric (pyccl windows)", sw.compared("nccl-symm", dtype)),
            ("torch one_shot", sw.torch_symm("one_shot", dtype, "eager")),
            ("torch two_shot", sw.torch_symm("two_shot", dtype, "eager")),
            ('dist "nccl"', sw.compared("torch.distributed", dtype)),
            ('dist "pyccl"', sw.compared("torch.distributed:pyccl", dtype)),
            ("torch.cuda.nccl", sw.compared("torch.cuda.nccl", dtype)),
            ("nccl-tests", sw.nccl_tests(f"nccl-tests {dtype} eager")),
            ("nccl-tests -R 2", sw.nccl_tests(f"nccl-tests {dtype} symmetric -R 2")),
            ("nccl-tests MPI", sw.nccl_tests(f"nccl-tests MPI {dtype} eager", mpi=True)),
        ]

    def part(title, cols, sizes=sizes):
        lines = table(cols, sizes)
        if lines:
            out.extend(["", f"### {title}", ""] + lines)

    part("float32 sum in place, eager (µs per call)", [
        ("pyccl auto", sw.algo("auto", "eager")),
        ("auto host", sw.algo("auto", "host")),
        ("own one-shot", sw.algo("oneshot", "eager")),
        ("own two-shot", sw.algo("twoshot", "eager")),
        ("NCCL (pyccl, algo=nccl)", sw.algo("nccl", "eager")),
    ] + eager_peers("float"))
    floor = (sw.algo("empty kernel", "launch floor") or {}).get(0)
    if floor is not None:
        out.extend(["", f"Launch floor, measured in the same run: {floor:.2f} µs of host time per "
                    "launch of an empty kernel with the own kernels' parameter block, launched as "
                    "they are (`auto host` less this is what a call adds to its launch)."])
    part("float32 sum in place, replayed from a CUDA graph (µs per call)", [
        ("pyccl auto", sw.algo("auto", "graph")),
        ("own one-shot", sw.algo("oneshot", "graph")),
        ("own two-shot", sw.algo("twoshot", "graph")),
        ("NCCL (pyccl, algo=nccl)", sw.algo("nccl", "graph")),
        ("NCCL symmetric (pyccl windows, -G 10)", sw.graphed("nccl-symm", "float")),
        ("torch one_shot", sw.torch_symm("one_shot", "float", "graph")),
        ("torch two_shot", sw.torch_symm("two_shot", "float", "graph")),
        ("nccl-tests -G 10", sw.nccl_tests("nccl-tests float graph -G 10")),
        ("nccl-tests MPI -G 10", sw.nccl_tests("nccl-tests MPI float graph -G 10", mpi=True)),
    ])
    part("bfloat16 sum in place, eager (µs per call)", [
        ("pyccl auto", sw.compared("pyccl", "bfloat16")),
    ] + eager_peers("bfloat16"))
    if sw.coll is not None:
        systems = sorted({r["system"] for r in sw.coll["results"]}, key=lambda s: (s != "pyccl", s))
        for coll in sorted({r["coll"] for r in sw.coll["results"]}):
            part(f"{coll}, float32, in place (µs per call)",
                 [(s, Sweep._results(sw.coll, s, "float", coll)) for s in systems], sizes=None)
    return out


def folders(out):
    """OUT's rank-count folders (r2, r3, ... in numeric order), or OUT itself."""
    subs = [d for d in os.listdir(out) if re.fullmatch(r"r\d+", d) and os.path.isdir(os.path.join(out, d))]
    return [os.path.join(out, d) for d in sorted(subs, key=lambda d: int(d[1:]))] or [out]


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv in (["-h"], ["--help"]):
        print(__doc__.split("\n\n")[1])
        return 0
    if len(argv) != 1:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    if not os.path.isdir(argv[0]):
        print(f"sweep_tables: {argv[0]} is not a folder", file=sys.stderr)
        return 2
    blocks = [tables(Sweep(f)) for f in folders(argv[0])]
    blocks = [b for b in blocks if len(b) > 1]
    if not blocks:
        print(f"sweep_tables: no sweep results in {argv[0]}", file=sys.stderr)
        return 1
    print("\n\n".join("\n".join(b) for b in blocks))
    return 0


if __name__ == "__main__":
    sys.exit(main())
