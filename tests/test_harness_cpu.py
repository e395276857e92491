"""CPU tier of the test harness itself (pyccl/bench/spawn.py, which the GPU tier reaches through
tests/_ranks.py and pyccl.bench shares): a rank that fails, crashes, hangs, or dies after
reporting fails the test promptly, names the rank, and leaves no process behind."""
import multiprocessing.util
import os
import re
import signal
import sys
import time

import pytest

from pyccl.bench.spawn import reserved_port, run_bounded, run_ranks


def _ok(rank, world):
    return rank * 10


def _segv_on_1(rank, world):
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSEGV)
    time.sleep(120)  # rank 0 waits "for its peer" forever


def _hang(rank, world, pidfile):
    with open(f"{pidfile}.{rank}", "w") as f:
        f.write(str(os.getpid()))
    time.sleep(120)


def _raise_on_1(rank, world):
    if rank == 1:
        raise ValueError("rank 1 fails on purpose")
    time.sleep(120)  # rank 0 waits "for its peer" forever


def _crash_at_exit_on_0(rank, world):
    if rank == 0:
        # runs after the result is flushed to the parent (the queue's own finalizer is -5)
        multiprocessing.util.Finalize(None, os._exit, args=(3,), exitpriority=-10)
    return rank


def _sigkill_on_1(rank, world):
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return rank + 5


def _gone(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # a zombie of ours counts as gone
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True


def test_results_of_every_rank():
    assert run_ranks(_ok, 2, make_comm=False, timeout=60) == {0: 0, 1: 10}


def test_a_crashed_rank_fails_fast_with_its_signal():
    t0 = time.monotonic()
    with pytest.raises(AssertionError, match=r"rank 1 died without reporting: killed by signal SIGSEGV \(11\)"):
        run_ranks(_segv_on_1, 2, make_comm=False, timeout=100)
    assert time.monotonic() - t0 < 60  # not the 100 s deadline


def test_a_failing_rank_reports_its_traceback_at_once():
    t0 = time.monotonic()
    with pytest.raises(AssertionError) as e:
        run_ranks(_raise_on_1, 2, make_comm=False, timeout=100)
    assert time.monotonic() - t0 < 60
    text = str(e.value)
    assert text.startswith("rank 1:\nTraceback") and "ValueError: rank 1 fails on purpose" in text


def test_a_rank_meant_to_be_killed_gives_the_others_results():
    assert run_ranks(_sigkill_on_1, 2, make_comm=False, timeout=60, killed=(1,)) == {0: 5}
    # a rank meant to be killed that reports and exits instead is a failure
    with pytest.raises(AssertionError, match=r"rank 0 was to be killed but ended with exit code 0"):
        run_ranks(_ok, 2, make_comm=False, timeout=60, killed=(0,))
    # any other death is still one
    with pytest.raises(AssertionError, match=r"rank 1 died without reporting: killed by signal SIGSEGV"):
        run_ranks(_segv_on_1, 2, make_comm=False, timeout=60, killed=(0,))


def test_a_crash_after_reporting_is_a_failure():
    with pytest.raises(AssertionError, match=r"rank 0 reported but then ended with exit code 3"):
        run_ranks(_crash_at_exit_on_0, 2, make_comm=False, timeout=60)


def test_a_hang_is_killed_at_the_deadline(tmp_path):
    pidfile = str(tmp_path / "pid")
    t0 = time.monotonic()
    with pytest.raises(AssertionError, match=r"timed out after 8s waiting for ranks \[0, 1\]"):
        run_ranks(_hang, 2, pidfile, make_comm=False, timeout=8)
    assert time.monotonic() - t0 < 40
    pids = [int(open(f"{pidfile}.{r}").read()) for r in range(2)]
    assert all(_gone(p) for p in pids), pids


def test_run_bounded_kills_the_whole_group(tmp_path):
    pidfile = tmp_path / "grandchild"
    # a launcher that starts a worker of its own, as torchrun or mpirun do
    code = ("import subprocess, sys, time; "
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
            f"open({str(pidfile)!r}, 'w').write(str(p.pid)); time.sleep(120)")
    with pytest.raises(AssertionError, match=r"timed out after 5s; its process group was killed"):
        run_bounded([sys.executable, "-c", code], timeout=5)
    time.sleep(0.5)
    assert _gone(int(pidfile.read_text()))


def test_run_bounded_returns_like_subprocess_run():
    r = run_bounded([sys.executable, "-c", "import sys; print('out'); sys.exit(4)"], timeout=60)
    assert (r.returncode, r.stdout) == (4, "out\n")


def test_reserved_port_stays_ours_and_lets_the_master_listen():
    import socket

    from pyccl.launch import _listen_fd

    with reserved_port() as port:
        with socket.socket() as other:  # someone else asking for that port is refused
            with pytest.raises(OSError):
                other.bind(("127.0.0.1", port))
        fd = _listen_fd("127.0.0.1", port)  # the rendezvous master is not
        os.close(fd)


# ---------------- PYCCL_EXPECT_GPUS (_gpu_tier.py) ----------------

_SKIPPING = '''
import pytest
from _gpu_tier import needs_gpus

@pytest.mark.bench
def test_bench_passes():
    pass

def test_passes():
    pass

@needs_gpus(1000)
def test_needs_more_gpus_than_any_machine():
    pass

def test_a_missing_tool():
    pytest.skip("mpirun is not installed")

@pytest.mark.skipif(True, reason="checks the no-GPU message; this machine has a GPU")
def test_no_gpu_path_only():
    pass
'''


def _pytest_on(tmp_path, expect):
    (tmp_path / "test_skips.py").write_text(_SKIPPING)
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.abspath(__file__)))
    env.pop("PYCCL_EXPECT_GPUS", None)
    if expect is not None:
        env["PYCCL_EXPECT_GPUS"] = str(expect)
    return run_bounded([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-c", os.devnull,
                        "-p", "_gpu_tier", "-W", "ignore::pytest.PytestUnknownMarkWarning",
                        str(tmp_path / "test_skips.py")], 120, env=env, cwd=str(tmp_path))


def test_without_expect_gpus_skips_are_skips(tmp_path):
    r = _pytest_on(tmp_path, None)
    assert r.returncode == 0, r.stdout
    assert "2 passed, 3 skipped" in r.stdout, r.stdout
    assert "passed: 1 pyccl behaviour, 1 benchmark tool" in r.stdout, r.stdout


def test_with_expect_gpus_a_missing_tool_fails(tmp_path):
    r = _pytest_on(tmp_path, 0)
    assert r.returncode == 1, r.stdout
    # needing 1000 GPUs when 0 are expected, and a no-GPU-only check, still skip
    assert "1 failed, 2 passed, 2 skipped" in r.stdout, r.stdout
    assert ("_ test_a_missing_tool _" in r.stdout and "PYCCL_EXPECT_GPUS=0: this test would have been "
            "skipped (Skipped: mpirun is not installed); on this machine that is a failure" in r.stdout), r.stdout


def test_which_skips_expect_gpus_allows():
    from _gpu_tier import _skip_allowed
    fewer = "checks a machine with fewer than 2 GPUs; this machine has 2 or more"
    no_gpu = "checks the no-GPU message; this machine has a GPU"
    needs = "needs 2 CUDA GPUs (memory on a second GPU), this machine has 1"
    # (reason, PYCCL_EXPECT_GPUS): allowed?
    cases = {(fewer, 1): False, (fewer, 2): True, (fewer, 8): True, (no_gpu, 1): True,
             (needs, 1): True, (needs, 2): False, ("mpirun is not installed", 4): False}
    assert {k: _skip_allowed(*k) for k in cases} == cases


_SAME_REASONS = '''
import pytest

@pytest.mark.parametrize("k", range(3))
def test_tool(k):
    pytest.skip("mpirun is not installed")

def test_other_tool():
    pytest.skip("cupy is not installed")
'''


def test_skips_are_counted_by_reason(tmp_path):
    """Without -rs (tools/test.sh): one line per skip reason with its count, not one per skip."""
    (tmp_path / "test_reasons.py").write_text(_SAME_REASONS)
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.abspath(__file__)))
    env.pop("PYCCL_EXPECT_GPUS", None)
    r = run_bounded([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", os.devnull,
                     "-p", "_gpu_tier", str(tmp_path / "test_reasons.py")], 120, env=env, cwd=str(tmp_path))
    assert r.returncode == 0, r.stdout
    # (the file as pytest names it: relative to its rootdir, here /dev with -c /dev/null)
    lines = [re.sub(r"\(in \S*test_reasons\.py\)", "(in test_reasons.py)", x) for x in r.stdout.splitlines()]
    at = lines.index("skipped 3 (in test_reasons.py): mpirun is not installed")
    assert lines[at + 1] == "skipped 1 (in test_reasons.py): cupy is not installed", r.stdout
    assert "SKIPPED [" not in r.stdout and "4 skipped" in r.stdout, r.stdout


def test_expect_gpus_with_broken_cuda_stops_the_session(tmp_path):
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: CUDA initialises")
    r = _pytest_on(tmp_path, 2)
    assert r.returncode == 3, r.stdout + r.stderr
    assert "PYCCL_EXPECT_GPUS=2, but CUDA initialisation failed" in r.stdout + r.stderr


def test_an_in_process_hang_ends_pytest_with_stacks(tmp_path):
    (tmp_path / "test_hang.py").write_text("import time\n\ndef test_hangs():\n    time.sleep(60)\n")
    (tmp_path / "conftest.py").write_text("from _gpu_tier import bounded_in_process  # noqa: F401\n")
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.abspath(__file__)), PYCCL_TEST_LIMIT_S="2")
    t0 = time.monotonic()
    r = run_bounded([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", os.devnull,
                     "--rootdir", str(tmp_path), str(tmp_path / "test_hang.py")], 50, env=env, cwd=str(tmp_path))
    assert time.monotonic() - t0 < 40
    assert r.returncode != 0 and "Timeout" in r.stderr and "test_hangs" in r.stderr, (r.returncode, r.stderr[-2000:])


def test_tools_test_sh_runs_the_paths_it_is_given_else_the_suite(tmp_path):
    """tools/test.sh hands its arguments to pytest: paths run only those, options alone the whole
    suite (pyproject.toml's testpaths).  Run on a copy of the script, the project's pytest
    settings and two test files (its set-up step stubbed)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    (tmp_path / "tools").mkdir()
    (tmp_path / "tests").mkdir()
    with open(os.path.join(root, "tools", "test.sh")) as f:
        (tmp_path / "tools" / "test.sh").write_text(f.read())
    (tmp_path / "tools" / "setup.sh").write_text("true\n")
    with open(os.path.join(root, "pyproject.toml")) as f:
        text = f.read()
    (tmp_path / "pyproject.toml").write_text(text[text.index("[tool.pytest.ini_options]"):])
    (tmp_path / "tests" / "test_a.py").write_text("def test_a1():\n    pass\n\n\ndef test_a2():\n    pass\n")
    (tmp_path / "tests" / "test_b.py").write_text("import pytest\n\n\ndef test_b():\n    pytest.skip('b')\n")
    env = dict(os.environ, PYTHON=sys.executable)

    def test_sh(*args):
        r = run_bounded(["bash", str(tmp_path / "tools" / "test.sh"), *args], 120, env=env, cwd="/")
        assert r.returncode in (0, 5), r.stdout + r.stderr
        return r.stdout.strip().splitlines()[-1]
    assert test_sh().startswith("2 passed, 1 skipped in")
    assert test_sh("tests/test_a.py").startswith("2 passed in")
    assert test_sh("tests/test_a.py::test_a2", "-rs").startswith("1 passed in")
    assert test_sh("-rs").startswith("2 passed, 1 skipped in")
    assert test_sh("-k", "a1 or b").startswith("1 passed, 1 skipped, 1 deselected in")
    assert test_sh("tests/test_b.py", "-k", "b").startswith("1 skipped in")


def test_the_gpu_marker_selects_every_gpu_test_and_no_other():
    """-m gpu collects the tests of *_gpu.py files and those marked needs_gpus/needs_ranks in
    other files (read here from the source), -m "not gpu" the rest."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    files = ["tests/test_ops_gpu.py", "tests/test_ops_cpu.py", "tests/test_bad_input.py"]

    def collect(*args):
        r = run_bounded([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                         *args, *files], 300, cwd=root)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        return {line for line in r.stdout.splitlines() if "::" in line}
    every, gpu, cpu = collect(), collect("-m", "gpu"), collect("-m", "not gpu")
    with open(os.path.join(root, "tests", "test_bad_input.py")) as f:
        needs = set(re.findall(r"^@needs_(?:gpus|ranks)\(.*\)\n(?:@.*\n)*def (\w+)", f.read(), re.M))
    assert len(needs) >= 9, needs
    want = {n for n in every if n.startswith("tests/test_ops_gpu.py::")
            or (n.startswith("tests/test_bad_input.py::") and n.split("::")[1].split("[")[0] in needs)}
    assert gpu == want, sorted(gpu ^ want)
    assert cpu == every - want, sorted(cpu ^ (every - want))
    assert any(n.startswith("tests/test_ops_cpu.py::") for n in cpu)
    assert any(n.startswith("tests/test_bad_input.py::") for n in cpu)


def test_every_planted_fault_still_applies():
    # tools/mutate.sh plants each fault by replacing a text of the code; a refactor that changes
    # that text would make the fault a no-op (or the run an error) without anyone noticing.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, os.path.join(root, "tools"))
    try:
        import _mutate
    finally:
        sys.path.pop(0)
    for fault in _mutate.FAULTS:
        with open(os.path.join(root, fault["file"])) as f:
            text = f.read()
        for old, new in fault["edits"]:
            assert old != new, fault["name"]
            assert text.count(old) == 1, (fault["name"], fault["file"], old[:80])


def test_gpu_check_parts_cover_the_whole_gpu_tier_once():
    """tools/gpu-check.sh --part 1..6 together run every GPU test file (a test_ar_gpu.py test
    that part 1 leaves out is one that part 2 names), and no file twice; the tests it names
    exist."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "tools", "gpu-check.sh")) as f:
        text = f.read()
    parts = re.findall(r"^    ([1-9])\) set -- (.*?);;", text, re.M | re.S)
    assert [p for p, _ in parts] == ["1", "2", "3", "4", "5", "6"], parts
    files, left_out, named = [], set(), set()
    for _, body in parts:
        words = body.replace("\\\n", " ").split()
        for i, w in enumerate(words):
            if w == "--deselect":
                left_out.add(words[i + 1])
            elif w.startswith("tests/") and words[i - 1] != "--deselect":
                if "::" in w:
                    named.add(w)
                else:
                    files.append(w)
    gpu = sorted(f"tests/{n}" for n in os.listdir(os.path.join(root, "tests"))
                 if re.fullmatch(r"test_\w+_gpu\.py", n)) + ["tests/test_bad_input.py"]
    assert len(files) == len(set(files)), files
    assert set(gpu) <= set(files) | {n.split("::")[0] for n in named}, set(gpu) - set(files)
    # a GPU file's test named alone is one that another part leaves out (a CPU file's test that
    # behaves differently with a GPU present is named alone in part 6)
    assert left_out == {n for n in named if n.split("::")[0] in gpu}, (left_out, named)
    for n in named | left_out:
        path, func = n.split("::")
        with open(os.path.join(root, path)) as f:
            assert re.search(rf"^def {re.escape(func.split('[')[0])}\(", f.read(), re.M), n


def test_the_simulated_launch_turns_programmatic_dependent_launch_on():
    """tests/_ar_sim.py launches the kernels with programmatic dependent launch as ar.c does: its
    launch attribute holds the attribute's id and 1 in the value union, where the driver reads
    it, and nothing else (so the chained-calls test schedules a kernel while the one before it
    still runs, and the attribute is written in its own memory, nowhere else)."""
    import _ar_sim as sim
    raw = bytes(sim.pdl_attr())
    assert len(raw) == 72
    assert int.from_bytes(raw[0:4], "little") == sim.PROGRAMMATIC_STREAM_SERIALIZATION == 6
    assert int.from_bytes(raw[8:12], "little") == 1
    assert raw[4:8] + raw[12:] == bytes(64)
