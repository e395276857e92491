"""GPU tier of pyccl.bench: a short checked sweep of every collective, and --compare."""
import json
import math
import os
import sys

import pytest

from conftest import gpu_count, needs_gpus, needs_ranks
from pyccl.bench.spawn import run_bounded

pytestmark = pytest.mark.bench

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
W = gpu_count()


def bench(*args, timeout=240):
    env = dict(os.environ, PYTHONPATH=ROOT)
    return run_bounded([sys.executable, "-m", "pyccl.bench", "-g", str(W), "-T", "60", *args],
                       timeout, env=env, cwd=ROOT)


@needs_ranks(2)
def test_every_collective_checked_exactly(tmp_path):
    out = tmp_path / "all.json"
    r = bench("-g", str(max(2, W)), "--coll", "all", "-b", "8", "-e", "1M", "-f", "32", "-n", "3", "-w", "1",
              "--repeats", "1", "-c", "1", "--json", str(out))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [x for x in json.load(open(out))["results"] if x["system"] == "pyccl"]
    colls = {x["coll"] for x in rows}
    assert colls == {"all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce",
                     "sendrecv", "alltoall"}, colls
    checked = [x for x in rows if x["wrong"] is not None]
    assert len(checked) >= 14 and all(x["wrong"] == 0 for x in checked), checked


@needs_gpus(1)
def test_compare_runs_four_systems(tmp_path):
    out = tmp_path / "cmp.json"
    r = bench("-b", "8", "-e", "64K", "-f", "64", "-n", "3", "-w", "1", "--repeats", "1",
              "--compare", "--json", str(out))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "# Comparison" in r.stdout
    rows = json.load(open(out))["results"]
    systems = {x["system"] for x in rows}
    assert systems == {"pyccl", "torch.distributed", "torch.distributed:pyccl", "torch.cuda.nccl"}, systems
    # the benchmark's own check of the data: dist.all_reduce on the "pyccl" group is right
    checked = [x for x in rows if x["system"] == "torch.distributed:pyccl" and x["wrong"] is not None]
    assert checked and all(x["wrong"] == 0 for x in checked), checked


def _own_kernel_run(tmp_path, g, *args):
    out = tmp_path / "own.json"
    r = bench("-g", str(g), "--repeats", "2", "--no-progress", "--json", str(out), *args)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.load(open(out))
    assert doc["results"] == [] and doc["host_overhead"] == []
    return r, doc


@needs_gpus(1)
def test_algos_on_one_gpu_measures_auto_and_nccl(tmp_path):
    """One rank: the own kernels refuse (2 to 8 ranks), so auto and NCCL only, said in a note."""
    r, doc = _own_kernel_run(tmp_path, 1, "-b", "8", "-e", "64K", "-f", "64", "-n", "5",
                             "--algos", "all")
    assert "# 1 rank: pyccl's own kernels need 2 to 8 ranks" in r.stdout
    rows = doc["algos"]
    got = {(x["size"], x["algo"], x["timing"]) for x in rows if x["size"] in (8, 512, 32768)}
    assert got == {(s, a, t) for s in (8, 512, 32768) for a in ("auto", "nccl")
                   for t in ("eager", "graph", "host")}, got
    steps = {(x["algo"], x["timing"]) for x in rows if x["timing"] in ("per-tensor loop", "coalesced")}
    assert steps == {(a, t) for a in ("auto", "nccl") for t in ("per-tensor loop", "coalesced")}
    assert all(x["time_us"] > 0 for x in rows) and doc["host_breakdown"] == []


@needs_ranks(2)
def test_algos_on_two_ranks_measure_own_kernels_and_variants(tmp_path):
    r, doc = _own_kernel_run(tmp_path, 2, "-b", "8", "-e", "64K", "-f", "64", "-n", "5",
                             "--algos", "all", "--variants", "PYCCL_AR_PDL=0")
    rows = doc["algos"]
    for algo in ("auto", "nccl", "oneshot", "twoshot"):
        assert {x["timing"] for x in rows if x["algo"] == algo and x["size"] == 8
                and x["variant"] is None} == {"eager", "graph", "host"}, algo
    variant = {(x["algo"], x["timing"]) for x in rows if x["variant"] == "PYCCL_AR_PDL=0"
               and x["size"] == 8}
    assert variant == {(a, t) for a in ("oneshot", "twoshot") for t in ("eager", "graph", "host")}
    assert doc["config"]["all_reduce_info"]["state"] == "ready", doc["config"]["all_reduce_info"]
    assert "one@PDL=0" in r.stdout and all(x["time_us"] > 0 for x in rows)
    # the launch floor, measured in the same run, printed above the host table and below the
    # own kernels' host time per call (which launches the same way and does more)
    floor = [x for x in rows if x["timing"] == "launch floor"]
    assert len(floor) == 1 and floor[0]["size"] == 0 and floor[0]["algo"] == "empty kernel", floor
    own_host = min(x["time_us"] for x in rows if x["algo"] == "oneshot" and x["timing"] == "host"
                   and x["variant"] is None)
    assert 0 < floor[0]["time_us"] < own_host, (floor, own_host)
    assert f"# launch floor: {floor[0]['time_us']:.2f} us per launch" in r.stdout


IN_C = ["in C: " + k for k in ("cudaGetDevice", "cudaStreamIsCapturing", "cudaEventRecord (timing off)",
                               "cudaEventQuery (finished)", "clock read", "mutex lock and unlock",
                               "GIL released and taken")]
ONE_RANK_CASES = ["python call of a no-op", "ctypes cuCtxGetDevice",
                  "ctypes cuLaunchKernel, empty kernel", "ctypes cuLaunchKernel, 144-byte param",
                  "comm.all_reduce(empty tensor)", "comm.all_reduce(8 B, algo='nccl')",
                  "raw ncclAllReduce via ctypes (8 B)",
                  "timed, blocking: comm.all_reduce(8 B, algo='nccl')",
                  "timed, non-blocking: comm.all_reduce(8 B, algo='nccl')"] + IN_C + [
                  "on a side stream: empty kernel launch"]


@needs_gpus(1)
def test_host_breakdown_on_one_gpu(tmp_path):
    r, doc = _own_kernel_run(tmp_path, 1, "--host-breakdown", "--host-iters", "50")
    cases = [x["case"] for x in doc["host_breakdown"]]
    assert cases == ONE_RANK_CASES, cases
    assert all(x["host_us"] > 0 and x["calls"] == 50 for x in doc["host_breakdown"])
    assert "raw ncclAllReduce via ctypes (8 B)" in r.stdout
    # the rows timed in C have a host figure only
    in_c = [x for x in doc["host_breakdown"] if x["case"] in IN_C]
    assert len(in_c) == len(IN_C) and all(math.isnan(x["gpu_us"]) for x in in_c), in_c
    assert all(x["gpu_us"] > 0 for x in doc["host_breakdown"] if x["case"] not in IN_C)
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("in C: cudaEventRecord"))
    assert line.split()[-1] == "-", line


@needs_ranks(2)
def test_host_breakdown_on_two_ranks_adds_the_own_kernel_rows(tmp_path):
    r, doc = _own_kernel_run(tmp_path, 2, "--host-breakdown", "--host-iters", "50")
    cases = [x["case"] for x in doc["host_breakdown"]]
    assert cases == ONE_RANK_CASES[:5] + [
        "comm.all_reduce(8 B): own kernel, PDL", "comm.all_reduce(8 B): own kernel, no PDL",
        "comm.all_reduce(8 B, algo='oneshot')"] + ONE_RANK_CASES[5:7] + [
        "timed, blocking: comm.all_reduce(8 B): own kernel", ONE_RANK_CASES[7],
        "timed, non-blocking: comm.all_reduce(8 B): own kernel", ONE_RANK_CASES[8]] + IN_C + [
        "on a side stream: own kernel, PDL", "on a side stream: empty kernel launch"], cases
    assert doc["config"]["all_reduce_info"][1]["pdl"] is False
