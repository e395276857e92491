"""Seeded fuzz of every public entry point on the stand-in GPU library (CPU tier).

pyccl.nccl.*, the Communicator's methods and properties, and pyccl._C's
functions are called with random and hostile arguments (tests/_fuzz.py):
tensor-likes whose attributes raise, lie, return fresh objects or empty
their list, __cuda_array_interface__ dicts that are malformed or huge,
streams and ops whose code destroys or aborts the communicator.  Every call
must return or raise TypeError, ValueError, RuntimeError (pyccl's errors
included) or the hostile code's own exception, and no call may reach NCCL
with a dead handle; never SystemError, never a crash.

Each batch runs in its own process (tests/child_fakegpu.py, scenario fuzz), so a
crash fails that batch and prints its seed.  Replay one batch with
    PYCCL_FUZZ_SEED=<seed> PYCCL_FUZZ_N=<calls> PYCCL_FUZZ_TRACE=1 \\
        python tests/child_fakegpu.py <libfakegpu.so> fuzz
Environment: PYCCL_FUZZ_CALLS (total calls, default 5000), PYCCL_FUZZ_SEED
(the first batch's seed, default 15; batch k uses seed + k).
"""
import json
import os
import subprocess
import sys

import pytest

from _fakes import build_fakegpu

HERE = os.path.dirname(os.path.abspath(__file__))
CALLS = int(os.environ.get("PYCCL_FUZZ_CALLS") or "5000")
SEED = int(os.environ.get("PYCCL_FUZZ_SEED") or "15")
PER_BATCH = 500
BATCHES = max(1, (CALLS + PER_BATCH - 1) // PER_BATCH)


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    path = build_fakegpu(tmp_path_factory.mktemp("fakegpu"))
    if path is None:
        pytest.skip("no C compiler to build the stand-in GPU library")
    return path


def run_batch(lib, seed, calls):
    env = dict(os.environ, PYCCL_FUZZ_SEED=str(seed), PYCCL_FUZZ_N=str(calls))
    env.pop("PYCCL_FUZZ_TRACE", None)
    env.pop("PYTHONPATH", None)
    try:
        r = subprocess.run([sys.executable, os.path.join(HERE, "child_fakegpu.py"), lib, "fuzz"],
                           capture_output=True, text=True, timeout=300, env=env)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"fuzz seed={seed} calls={calls}: hung (no result in 300 s)\n{e.stdout}")
    lines = r.stdout.splitlines()
    results = [json.loads(line[7:]) for line in lines if line.startswith("RESULT ")]
    why = f"rc {r.returncode}" + (f" (signal {-r.returncode})" if r.returncode < 0 else "")
    assert r.returncode == 0 and results, (
        f"fuzz seed={seed} calls={calls} failed: {why}\n"
        f"replay: PYCCL_FUZZ_SEED={seed} PYCCL_FUZZ_N={calls} PYCCL_FUZZ_TRACE=1 "
        f"python tests/child_fakegpu.py {lib} fuzz\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}")
    return results[0]


@pytest.mark.parametrize("batch", range(BATCHES), ids=[f"seed{SEED + k}" for k in range(BATCHES)])
def test_fuzz_batch(lib, batch):
    calls = min(PER_BATCH, CALLS - batch * PER_BATCH)
    res = run_batch(lib, SEED + batch, calls)
    counts = res["counts"]
    assert sum(counts.values()) == calls
    assert not any(k.endswith(":SystemError") for k in counts)


def test_fuzz_reaches_every_kind_of_outcome(lib):
    """The generator is not stuck on one error: calls succeed and fail in
    each expected way, over many entry points."""
    counts = run_batch(lib, SEED, PER_BATCH)["counts"]
    kinds = {k.split(":")[1] for k in counts}
    assert {"ok", "TypeError", "ValueError", "RuntimeError", "HostileError"} <= kinds, kinds
    ok = {k.split(":")[0] for k in counts if k.endswith(":ok")}
    assert len(ok) >= 15, sorted(ok)
