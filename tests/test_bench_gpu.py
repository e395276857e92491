"""GPU tier of pyccl.bench: a short checked sweep of every collective, and --compare."""
import json
import os
import sys

import pytest

from conftest import gpu_count, needs_gpus
from _ranks import run_bounded

pytestmark = pytest.mark.bench

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
W = gpu_count()


def bench(*args, timeout=240):
    env = dict(os.environ, PYTHONPATH=ROOT)
    return run_bounded([sys.executable, "-m", "pyccl.bench", "-g", str(W), "-T", "60", *args],
                       timeout, env=env, cwd=ROOT)


@needs_gpus(2)
def test_every_collective_checked_exactly(tmp_path):
    out = tmp_path / "all.json"
    r = bench("-t", "all", "-b", "8", "-e", "1M", "-f", "32", "-n", "3", "-w", "1",
              "--repeats", "1", "-c", "1", "--json", str(out))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [x for x in json.load(open(out))["results"] if x["system"] == "pyccl"]
    colls = {x["coll"] for x in rows}
    assert colls == {"all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce",
                     "sendrecv", "alltoall"}, colls
    checked = [x for x in rows if x["wrong"] is not None]
    assert len(checked) >= 14 and all(x["wrong"] == 0 for x in checked), checked


@needs_gpus(2)
def test_compare_runs_three_systems(tmp_path):
    out = tmp_path / "cmp.json"
    r = bench("-b", "8", "-e", "64K", "-f", "64", "-n", "3", "-w", "1", "--repeats", "1",
              "--compare", "--json", str(out))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "# Comparison" in r.stdout
    systems = {x["system"] for x in json.load(open(out))["results"]}
    assert systems == {"pyccl", "torch.distributed", "torch.cuda.nccl"}, systems
