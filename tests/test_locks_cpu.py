"""The one lock order of csrc/locks.h: every lock of pyccl._C is taken through its calls, and a
debug build (PYCCL_DEBUG=1) checks the order at every lock, and that no thread waits for a
set-up's or a communicator's lock with the GIL held (their holders may take the GIL).  The stand-in scenarios of threads
racing destroy(), abort() and close() run on such a build here, and tools/sanitize.sh (in CI)
runs the whole lifecycle and timeout files on one: a lock taken against the order, or twice,
aborts the scenario's process with both locks named."""
import glob
import os
import re
import shutil
import signal
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CSRC = os.path.join(REPO, "csrc")


def test_every_lock_goes_through_locks_h():
    raw = re.compile(r"\bpthread_mutex_(lock|trylock|unlock)\s*\(")
    for path in sorted(glob.glob(os.path.join(CSRC, "*.[ch]"))):
        if os.path.basename(path) in ("locks.h", "locks.c"):
            continue
        with open(path, encoding="utf-8") as f:
            text = f.read()
        assert not raw.search(text), f"{path}: a lock taken outside locks.h's calls"


def test_every_lock_class_is_in_the_written_order():
    with open(os.path.join(CSRC, "locks.h"), encoding="utf-8") as f:
        header = f.read()
    table = header.split("*/", 1)[0]
    classes = re.findall(r"^\s+(PYCCL_LOCK_[A-Z]+) = 1,|^\s+(PYCCL_LOCK_[A-Z]+),", header, re.M)
    classes = [a or b for a, b in classes]
    assert len(classes) >= 6
    for cls in classes:
        assert cls in table, f"{cls} is not in locks.h's written order"
    used = set()
    for path in glob.glob(os.path.join(CSRC, "*.c")):
        with open(path, encoding="utf-8") as f:
            used |= set(re.findall(r"PYCCL_LOCK_[A-Z]+", f.read()))
    assert set(classes) <= used, set(classes) - used


@pytest.fixture(scope="module")
def debug_build(tmp_path_factory):
    """A copy of the checkout built with PYCCL_DEBUG=1 (the kernels are not what it checks:
    an earlier build's are used, or none)."""
    root = tmp_path_factory.mktemp("debug-build")
    for name in ("csrc", "pyccl", "tests"):
        shutil.copytree(os.path.join(REPO, name), root / name,
                        ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(os.path.join(REPO, name), root / name)
    kernels = os.path.join(REPO, "build", "kernels")
    os.makedirs(root / "build" / "kernels")
    archs = "90"
    fatbins = sorted(glob.glob(os.path.join(kernels, "pyccl_allreduce-sm_*.fatbin")))
    if fatbins:
        shutil.copy(fatbins[-1], root / "build" / "kernels")
        archs = os.path.basename(fatbins[-1])[len("pyccl_allreduce-sm_"):-len(".fatbin")].replace("_", ";")
    else:  # no nvcc run here: an empty one stands in (the CPU tier never loads it)
        (root / "build" / "kernels" / "pyccl_allreduce-sm_90.fatbin").write_bytes(b"")
    env = dict(os.environ, PYCCL_DEBUG="1", PYCCL_CUDA_ARCHS=archs)
    r = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=root, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "PYCCL_DEBUG_LOCKS" in r.stdout + r.stderr
    return root


def _env():
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    return env


@pytest.mark.parametrize("gil, text", [
    (False, r"taking the kernels' load_mu \(0x[0-9a-f]+\) while holding a region list's mu "
            r"\(0x[0-9a-f]+\)"),
    (True, r"waiting with the GIL held for a communicator's mu \(0x[0-9a-f]+\)"),
])
def test_debug_build_aborts_on_a_broken_order(debug_build, gil, text):
    r = subprocess.run([sys.executable, "-c",
                        f"import pyccl._C as C; C._debug_break_lock_order({gil})"],
                       cwd=debug_build, env=_env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == -signal.SIGABRT, (r.returncode, r.stderr[-2000:])
    assert re.search(r"pyccl: lock order broken: " + text + r"; the order is csrc/locks.h's",
                     r.stderr), r.stderr[-2000:]


def test_release_build_has_no_check():
    import pyccl._C as C
    assert not hasattr(C, "_debug_break_lock_order")


def test_races_keep_the_order(debug_build):
    """Threads sharing communicators, a call over two, abort from another thread, groups and
    close() beside abort() on the debug build: every one passes, none aborts (the whole
    lifecycle and timeout files run on one in tools/sanitize.sh)."""
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
                        "tests/test_lifecycle_cpu.py", "tests/test_timeout_cpu.py",
                        "-k", "threads_share or two_comms or abort_from_thread or group_calls or close_beside"],
                       cwd=debug_build, env=_env(), capture_output=True, text=True, timeout=900)
    assert "lock order broken" not in r.stdout + r.stderr, (r.stdout[-3000:], r.stderr[-3000:])
    assert r.returncode == 0, r.stdout[-4000:]
    passed = re.search(r"(\d+) passed", r.stdout)
    assert passed and int(passed.group(1)) >= 8, r.stdout[-2000:]
