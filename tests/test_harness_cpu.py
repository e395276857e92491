"""CPU tier of the test harness itself (_ranks.py): a rank that crashes, hangs,
or dies after reporting fails the test promptly, names the rank, and leaves no
process behind."""
import multiprocessing.util
import os
import signal
import sys
import time

import pytest

from _ranks import reserved_port, run_bounded, run_ranks


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


def _crash_at_exit_on_0(rank, world):
    if rank == 0:
        # runs after the result is flushed to the parent (the queue's own finalizer is -5)
        multiprocessing.util.Finalize(None, os._exit, args=(3,), exitpriority=-10)
    return rank


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
