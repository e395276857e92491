"""pytest plugin (loaded by conftest.py): how many GPUs this machine has, the
skip marker for too few, the `gpu` marker, PYCCL_EXPECT_GPUS, and the pass count
split into pyccl behaviour and benchmark tool.

The `gpu` marker (pyproject.toml) marks every GPU test: each test of a
tests/*_gpu.py file and each test elsewhere that needs GPUs (needs_gpus or
needs_ranks), so `-m gpu` selects the GPU tier and `-m "not gpu"` the CPU tier.

PYCCL_EXPECT_GPUS=N says "this machine has N usable GPUs" (tools/gpu-check.sh
sets it from nvidia-smi).  With it:
- a CUDA initialisation error, or torch seeing fewer than N GPUs, stops the
  session at once with the error, instead of the GPU tier skipping as if this
  were a CPU machine;
- every skip is a failure, except a test that needs more GPUs than N (a 1-GPU
  machine expects 1 and still skips the 2-GPU tests), one of the no-GPU path
  only, and one of what a machine with fewer GPUs than N says.  A missing tool (cupy,
  mpi4py, mpirun, compute-sanitizer, pyccl built without nvcc) is a failure.
Without it, a CUDA initialisation error still shows in every "needs N GPUs"
skip reason.
"""
import faulthandler
import os
import re
import sys

import pytest
import torch

_probe = None


def expected_gpus():
    v = os.environ.get("PYCCL_EXPECT_GPUS", "").strip()
    return int(v) if v else None


def _probe_gpus():
    """(count, error text or None), once per process."""
    global _probe
    if _probe is None:
        try:
            # init() raises the real error where is_available() only says False; it is
            # skipped on a healthy machine without PYCCL_EXPECT_GPUS (no CUDA state made
            # in pytest's own process beyond what the tests make)
            if expected_gpus() is not None or not torch.cuda.is_available():
                torch.cuda.init()
            _probe = (torch.cuda.device_count(), None)
        except Exception as e:  # no driver / no GPU / broken CUDA install
            _probe = (0, f"{type(e).__name__}: {e}")
    return _probe


def gpu_count():
    return _probe_gpus()[0]


def needs_gpus(n, why=None):
    """Skip unless the machine has n GPUs.  For n >= 2, only tests whose point is distinct GPUs
    (peer access between devices, one process driving several GPUs, speed) use this, `why`
    saying which; a multi-rank test uses needs_ranks."""
    have, err = _probe_gpus()
    failed = f" (CUDA initialisation failed: {err})" if err else ""
    what = f" ({why})" if why else ""
    return pytest.mark.skipif(have < n, reason=f"needs {n} CUDA GPUs{what}, this machine has {have}{failed}")


def needs_ranks(n):
    """A test of n ranks, one process each: any machine with a GPU runs it, the ranks placed on
    its GPUs round-robin (pyccl.place_rank), sharing them where ranks outnumber GPUs."""
    return needs_gpus(1)


def ranks_share_gpus(world):
    """True where `world` ranks would share this machine's GPUs."""
    return gpu_count() < world


_NEEDS = re.compile(r"needs (\d+) CUDA GPU")
# a test of what a machine with too few GPUs says (a tool's refusal), on one with enough
_FEWER = re.compile(r"checks a machine with fewer than (\d+) GPUs")


def is_gpu_test(item):
    """True for a test of a *_gpu.py file, or one that needs_gpus/needs_ranks marks."""
    if item.path.name.endswith("_gpu.py"):
        return True
    return any(_NEEDS.match(str(m.kwargs.get("reason", ""))) for m in item.iter_markers("skipif"))


def pytest_collection_modifyitems(config, items):
    for item in items:
        if is_gpu_test(item):
            item.add_marker(pytest.mark.gpu)


def _skip_allowed(reason, expect):
    m = _NEEDS.search(reason)
    if m and int(m.group(1)) > expect:
        return True
    m = _FEWER.search(reason)
    if m and int(m.group(1)) <= expect:
        return True
    return "this machine has a GPU" in reason  # a test of the no-GPU path only


def pytest_sessionstart(session):
    expect = expected_gpus()
    if expect is None:
        return
    have, err = _probe_gpus()
    if err is not None and expect > 0:
        pytest.exit(f"PYCCL_EXPECT_GPUS={expect}, but CUDA initialisation failed: {err}", returncode=3)
    if have < expect:
        pytest.exit(f"PYCCL_EXPECT_GPUS={expect}, but torch sees {have} GPUs", returncode=3)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    expect = expected_gpus()
    if expect is None or not rep.skipped or hasattr(rep, "wasxfail"):
        return
    reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
    if not _skip_allowed(reason, expect):
        rep.outcome = "failed"
        rep.longrepr = (f"PYCCL_EXPECT_GPUS={expect}: this test would have been skipped "
                        f"({reason}); on this machine that is a failure")


@pytest.fixture(autouse=True)
def bounded_in_process(request):
    """In-process tests (a GPU call that never returns) get a limit too: without
    pytest-timeout's --timeout, faulthandler dumps every thread's stack and ends pytest
    after PYCCL_TEST_LIMIT_S (900 s; the longest multi-process test allows itself 420 s)."""
    if getattr(request.config.option, "timeout", None):
        yield
        return
    try:  # the stderr pytest's own faulthandler writes to (fd 2 itself is captured)
        from _pytest.faulthandler import fault_handler_stderr_fd_key
        out = request.config.stash[fault_handler_stderr_fd_key]
    except (ImportError, KeyError):
        out = sys.__stderr__
    faulthandler.dump_traceback_later(float(os.environ.get("PYCCL_TEST_LIMIT_S") or "900"), exit=True,
                                      file=out)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


def _skip_reason(rep):
    reason = rep.longrepr[2] if isinstance(rep.longrepr, tuple) else str(rep.longrepr)
    return reason[len("Skipped: "):] if reason.startswith("Skipped: ") else reason


def skip_summary(reports):
    """Lines "skipped N (in K files): reason", one per reason, most skips first."""
    groups = {}
    for rep in reports:
        path = rep.location[0] if rep.location else rep.nodeid.split("::")[0]
        count, files = groups.setdefault(_skip_reason(rep), [0, set()])
        groups[_skip_reason(rep)] = [count + 1, files | {path}]
    lines = []
    for reason, (count, files) in sorted(groups.items(), key=lambda kv: (-kv[1][0], kv[0])):
        where = f"in {len(files)} files" if len(files) > 1 else f"in {next(iter(files))}"
        lines.append(f"skipped {count} ({where}): {reason}")
    return lines


def pytest_terminal_summary(terminalreporter):
    passed = [r for r in terminalreporter.stats.get("passed", []) if r.when == "call"]
    bench = sum(1 for r in passed if "bench" in r.keywords)
    terminalreporter.write_line(f"passed: {len(passed) - bench} pyccl behaviour, {bench} benchmark tool "
                                f"(marker 'bench')")
    # skips by reason (pytest's -rs lists every one: on a machine without GPUs, a hundred lines
    # that differ only in the test's line number)
    for line in skip_summary(terminalreporter.stats.get("skipped", [])):
        terminalreporter.write_line(line)
