"""CPU tier: the end of a communicator's life while other threads or an open pyccl.group()
use it, on the stand-in GPU library (tests/fakegpu/fakegpu.c).

destroy(), abort() and a Registration's close() each decide once, under the communicator's
lock, before doing anything: a call on another thread meets either the live communicator or
a destroyed one, never one half freed; a group that has not ended keeps its communicators
(destroy and abort refuse, changing nothing); every registration is deregistered exactly
once.  The scenarios are tests/child_fakegpu.py's "lifecycle" section, each in a process of
its own, bounded in time: a crash is a nonzero exit, a hang is a thread the child reports
stuck (exit 3) or, at the latest, the subprocess timeout.  The races are tried many times,
each try on a fresh communicator, with the stand-in holding each deregister call open a
little (dereg_delay) so that the other thread meets the destroy half done.
"""
import json
import os
import subprocess
import sys

import pytest

from _fakes import build_fakegpu

HERE = os.path.dirname(os.path.abspath(__file__))
LIMIT = 60  # s for one scenario's process


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    out = build_fakegpu(tmp_path_factory.mktemp("fakegpu"))
    if out is None:
        pytest.skip("no C compiler to build the stand-in GPU library")
    return out


def run(lib, scenario, **params):
    """The scenario's RESULT, run with params (JSON on its stdin); fails on a crash, a
    nonzero exit, misuse or two threads inside NCCL counted at exit, or a hang."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    what = f"{scenario} {params}"
    try:
        r = subprocess.run([sys.executable, os.path.join(HERE, "child_fakegpu.py"), lib, scenario],
                           input=json.dumps(params), capture_output=True, text=True, timeout=LIMIT,
                           env=env)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or ""
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else e.stderr or ""
        pytest.fail(f"{what}: still running after {LIMIT} s (hung)\n{out[-2000:]}\n{err[-3000:]}")
    lines = r.stdout.splitlines()
    results = [json.loads(line[7:]) for line in lines if line.startswith("RESULT ")]
    at_exit = [json.loads(line[8:]) for line in lines if line.startswith("AT_EXIT ")]
    assert r.returncode == 0 and results, (
        f"{what}: exit status {r.returncode}" + (" (hung: a thread did not finish)" if r.returncode == 3 else "")
        + f"\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")
    assert at_exit and at_exit[0]["misuse"] == 0 and at_exit[0]["concurrent"] == 0, (what, at_exit)
    return results[0]


TIMEOUTS = [pytest.param(5.0, id="timeout"), pytest.param(None, id="untimed")]


# ---------------------------------------------------------------- destroy beside another thread

@pytest.mark.parametrize("timeout", TIMEOUTS)
@pytest.mark.parametrize("op", ["abort", "premul", "all_reduce", "close", "get_async_error"])
def test_destroy_beside_another_threads_call(lib, op, timeout):
    # thread A repeats the call (abort(), all_reduce with premul_sum or plain, a
    # Registration's close(), get_async_error()) while thread B destroys: no crash, no
    # hang, A's errors only "has been destroyed"/"has been aborted" (or abort's "in use"),
    # B's only "in use" (then it retries), each registration deregistered once
    got = run(lib, "destroy_beside", op=op, timeout=timeout, tries=150)
    assert got["tries"] == 150
    if op != "abort":
        assert got["dereg_calls"] == got["registrations"], got


@pytest.mark.parametrize("timeout", TIMEOUTS)
@pytest.mark.parametrize("op", ["broadcast", "reduce", "all_gather"])
def test_call_begun_while_another_thread_destroys(lib, op, timeout):
    # the call's argument reading lets thread B's destroy() begin: the call then meets a
    # communicator whose destroy() was decided and raises, as one after it would, enqueuing
    # nothing (with a timeout, the watch's enqueue is the check)
    got = run(lib, "destroy_while_reading_arguments", op=op, timeout=timeout)
    assert got["call"] == ["RuntimeError", f"{op}: the communicator (rank 0 of 2) has been destroyed"], got
    assert got["destroy"] is None and got["destroyed"], got
    assert got["enqueued"] == 0, got


# ---------------------------------------------------------------- abort beside a call of several NCCL calls

# one NCCL call on a non-blocking handle (all_reduce, split) is what abort() claims, aborting
# the handle under it by design (test_timeout_cpu's launch_queue_full): not among these
ABORT_BESIDE = [pytest.param(op, t, b, id=f"{op}-{kind}")
                for kind, t, b in (("nonblocking", 5.0, False), ("blocking", 5.0, True),
                                   ("untimed", None, None))
                for op in ("all_gather", "premul", "group", "all_reduce", "split")
                if not (kind == "nonblocking" and op in ("all_reduce", "split"))]


@pytest.mark.parametrize("op,timeout,blocking", ABORT_BESIDE)
def test_abort_never_ends_the_handle_between_a_calls_nccl_calls(lib, op, timeout, blocking):
    # all_gather into a list (a group of broadcasts), premul_sum (the op made and destroyed
    # around the all_reduce), a pyccl.group() of two, one all_reduce, a split: abort() on
    # another thread waits for the call's NCCL calls to end, never aborting the handle between
    # them or under one (misuse counted by the stand-in at exit), and is never refused for
    # the call in flight, with or without a timeout (before, without one, it was refused "in
    # use by another thread"); the call raises "has been aborted" or completes
    got = run(lib, "abort_beside", op=op, timeout=timeout, blocking=blocking, tries=40)
    assert got["tries"] == 40


def test_abort_waits_for_a_call_inside_nccl_without_a_timeout(lib):
    # a deregistration inside NCCL for 1 s on another thread: abort() returns after it (never
    # aborting under it), the close succeeded; on the main thread a signal handler's
    # exception ends that wait and the communicator still works
    assert run(lib, "abort_waits_for_a_call_inside_nccl") == "ok"


@pytest.mark.parametrize("timeout", TIMEOUTS)
def test_get_async_error_beside_another_threads_calls(lib, timeout):
    # get_async_error() takes the communicator's lock like every NCCL call on it: the
    # stand-in counts no second thread inside NCCL (before, without a timeout, hundreds)
    got = run(lib, "async_error_beside", timeout=timeout, tries=3000)
    assert got == {"tries": 3000, "concurrent": 0}, got


# ---------------------------------------------------------------- an open pyccl.group()

@pytest.mark.parametrize("timeout", TIMEOUTS)
@pytest.mark.parametrize("whose", ["mine", "other_thread"])
def test_open_group_keeps_the_communicator(lib, whose, timeout):
    # destroy() and abort() refused with their exact messages, with and without a timeout,
    # the group this thread's or another's; nothing changed (registrations open, no
    # deregister, not aborted); after the group: its all_reduce right, the communicator
    # works, destroy() succeeds and deregisters
    assert run(lib, "group_keeps_comm", timeout=timeout, whose=whose) == "ok"


@pytest.mark.parametrize("timeout", TIMEOUTS)
@pytest.mark.parametrize("end", ["destroy", "abort"])
def test_group_of_a_thread_that_ended(lib, timeout, end):
    # a thread that ends with its group open no longer pins the communicator: the next call
    # raises why (its queued work never ran; the communicator was aborted), and destroy()
    # or abort() work
    assert run(lib, "group_of_a_thread_that_ended", timeout=timeout, end=end) == "ok"


@pytest.mark.parametrize("timeout", TIMEOUTS)
def test_barrier_refused_inside_a_group(lib, timeout):
    # "barrier: cannot wait inside pyccl.group(); call it after the group ends", first in
    # the group and after queued work; the group's own all_reduce still runs, once
    assert run(lib, "barrier_in_group", timeout=timeout) == "ok"


# ---------------------------------------------------------------- registrations

@pytest.mark.parametrize("timeout", TIMEOUTS)
@pytest.mark.parametrize("how", ["close", "destroy"])
def test_registration_deregistered_once(lib, how, timeout):
    # two threads close one registration at once (both return None), or one closes it
    # while the other destroys its communicator: one deregister call per registration
    got = run(lib, "close_once", how=how, timeout=timeout, tries=60)
    assert got["tries"] == 60


@pytest.mark.parametrize("timeout", TIMEOUTS)
def test_close_waits_for_the_work_on_its_memory(lib, timeout):
    # close() and destroy() deregister after the work enqueued so far ended (before: at
    # once, under a collective still reading the memory); refused inside an open group
    assert run(lib, "close_waits_for_work", timeout=timeout) == {"dereg_busy": 0, "dereg_calls": 4}


@pytest.mark.parametrize("timeout", TIMEOUTS)
def test_close_beside_abort(lib, timeout):
    # a registration's close() racing abort() on another thread: deregistered on the live
    # handle or "has been aborted", never NCCL's error for a NULL handle, and the
    # communicator's lock left free
    got = run(lib, "close_beside_abort", timeout=timeout, tries=300)
    assert got["tries"] == 300


@pytest.mark.parametrize("timeout,blocking", [(5.0, None), (5.0, True), (None, None)],
                         ids=["timeout", "timeout-blocking", "untimed"])
def test_fork_beside_a_call(lib, timeout, blocking):
    # a child made by fork() while a parent's thread was inside calls: its copy of the
    # communicator raises at once naming both processes (before, the child could hang on the
    # inherited lock), abort() and destroy() forget it; the parent's one works on
    got = run(lib, "fork_beside_a_call", timeout=timeout, blocking=blocking, tries=20)
    assert got == {"tries": 20}


# ---------------------------------------------------------------- premul_sum with algo=

@pytest.mark.parametrize("timeout", TIMEOUTS)
def test_premul_with_own_kernel_algo_refused_before_the_op_is_made(lib, timeout):
    # the existing ValueError, with no ncclRedOpCreatePreMulSum made (so none to destroy
    # outside the communicator's lock)
    assert run(lib, "premul_forced_algo", timeout=timeout) == "ok"


# ---------------------------------------------------------------- the own kernels' thresholds

def test_auto_thresholds_by_rank_count(lib):
    # ar.c's one table: 2 ranks the whole 16 MiB buffer for both kernels; 3 and 4 ranks one-shot
    # to 512 KiB and two-shot to 8 MiB (the 3- and 4-rank sweeps); other counts 512 KiB and
    # 4 MiB (not measured); all capped at the buffer; PYCCL_AR_ONESHOT_MAX/TWOSHOT_MAX override,
    # also above the buffer (such calls run in chunks of it)
    kib, mib = 1 << 10, 1 << 20
    got = run(lib, "thresholds_by_rank_count")
    assert got == {"2": [16 * mib, 16 * mib, 16 * mib], "3": [512 * kib, 8 * mib, 16 * mib],
                   "4": [512 * kib, 8 * mib, 16 * mib], "5": [512 * kib, 4 * mib, 16 * mib],
                   "8": [512 * kib, 4 * mib, 16 * mib], "4, overridden": [1 * mib, 64 * mib, 16 * mib]}, got
