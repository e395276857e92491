"""CPU tier of communicators with a timeout (csrc/watchdog.c).

Two parts: the API surface and argument errors (no GPU needed), and the
timeout machinery itself run against tests/fakegpu/fakegpu.c, a stand-in for
libnccl/libcudart that simulates stuck kernels, slow or hung init and
connection setup, asynchronous errors and aborts, and counts misuse (a
communicator used after abort or from two threads at once).  Each fake
scenario (tests/child_fakegpu.py) runs in its own process, bounded in time.
"""
import inspect
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import sysconfig
import time

import pytest

import _fakes
import pyccl

HERE = os.path.dirname(os.path.abspath(__file__))


def raises(exc, text):
    return pytest.raises(exc, match="^" + re.escape(text) + "$")


# ---------------------------------------------------------------- surface

def test_timeout_error_hierarchy():
    E = pyccl.NcclTimeoutError
    assert E.__module__ == "pyccl" and E.__name__ == "NcclTimeoutError"
    assert issubclass(E, pyccl.NcclError) and issubclass(E, RuntimeError)
    assert issubclass(E, TimeoutError)
    assert not issubclass(pyccl.NcclError, TimeoutError)
    e = E("all_reduce: rank 0 of 2 timed out")
    assert str(e) == "all_reduce: rank 0 of 2 timed out" and e.args == ("all_reduce: rank 0 of 2 timed out",)
    with pytest.raises(TimeoutError):
        raise e
    assert "NcclTimeoutError" in pyccl.__all__ and pyccl.NcclTimeoutError is pyccl._C.NcclTimeoutError
    assert "timeout" in E.__doc__


def test_signatures_and_docs():
    assert str(inspect.signature(pyccl.Communicator)) == \
        "(world_size, unique_id, rank, device=None, timeout=None, *, blocking=None)"
    assert "timeout" in pyccl.Communicator.__doc__ and "blocking" in pyccl.Communicator.__doc__
    assert "non-blocking" in pyccl.Communicator.blocking.__doc__
    assert str(inspect.signature(pyccl.Communicator.wait)) == "(self, /, timeout=None)"
    for name in ("abort", "wait", "get_async_error"):
        doc = getattr(pyccl.Communicator, name).__doc__
        assert doc and len(doc) > 80, name
    assert type(pyccl.Communicator.timeout).__name__ == "getset_descriptor"
    assert "seconds" in pyccl.Communicator.timeout.__doc__
    assert list(inspect.signature(pyccl.init_from_env).parameters) == ["timeout", "device"]
    assert inspect.signature(pyccl.init_from_env).parameters["timeout"].default == 300.0
    assert inspect.signature(pyccl.init_rank).parameters["timeout"].default is None
    assert inspect.signature(pyccl.init_from_mpi).parameters["timeout"].default is None


BAD_TIMEOUTS = [
    ("5", TypeError, "timeout must be a number of seconds (int or float), a datetime.timedelta or None, got str"),
    (True, TypeError, "timeout must be a number of seconds (int or float), a datetime.timedelta or None, got bool"),
    ([5], TypeError, "timeout must be a number of seconds (int or float), a datetime.timedelta or None, got list"),
    (0, ValueError, "timeout must be a finite number of seconds > 0, got 0"),
    (-1.5, ValueError, "timeout must be a finite number of seconds > 0, got -1.5"),
    (float("nan"), ValueError, "timeout must be a finite number of seconds > 0, got nan"),
    (float("inf"), ValueError, "timeout must be a finite number of seconds > 0, got inf"),
]


@pytest.mark.parametrize("value,exc,text", BAD_TIMEOUTS, ids=[repr(v[0]) for v in BAD_TIMEOUTS])
def test_communicator_timeout_errors(value, exc, text):
    # checked with the other arguments, before any GPU is touched
    uid = pyccl.unique_id()
    with raises(exc, "Communicator: " + text):
        pyccl.Communicator(2, uid, 0, timeout=value)
    with raises(exc, "Communicator: " + text):
        pyccl.Communicator(2, uid, 0, None, value)
    with raises(exc, "Communicator: " + text):
        pyccl.init_rank(2, uid, 0, timeout=value)


@pytest.mark.parametrize("value,exc,text", BAD_TIMEOUTS, ids=[repr(v[0]) for v in BAD_TIMEOUTS])
def test_launcher_timeout_errors(monkeypatch, value, exc, text):
    for k, v in {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}.items():
        monkeypatch.setenv(k, v)
    with raises(exc, "init_from_env: " + text):
        pyccl.init_from_env(timeout=value)
    with raises(exc, "init_from_mpi: " + text):
        pyccl.init_from_mpi(timeout=value)


def test_read_timeout_accepts():
    assert pyccl._C._read_timeout("x", None) is None
    assert pyccl._C._read_timeout("x", 5) == 5.0 and type(pyccl._C._read_timeout("x", 5)) is float
    assert pyccl._C._read_timeout("x", 0.25) == 0.25
    assert pyccl._C._read_timeout("x", 1e9) == 1e9
    # datetime.timedelta, as torch.distributed takes it: its total_seconds()
    import datetime
    assert pyccl._C._read_timeout("x", datetime.timedelta(seconds=90, milliseconds=500)) == 90.5
    assert pyccl._C._read_timeout("x", datetime.timedelta(days=1)) == 86400.0

    class Later(datetime.timedelta):  # a subclass is one too
        pass
    assert pyccl._C._read_timeout("x", Later(seconds=2)) == 2.0
    with raises(ValueError, "x: timeout must be a finite number of seconds > 0, got datetime.timedelta(0)"):
        pyccl._C._read_timeout("x", datetime.timedelta(0))
    with raises(ValueError, "Communicator: timeout must be a finite number of seconds > 0, "
                            "got datetime.timedelta(days=-1, seconds=86399)"):
        pyccl.Communicator(2, pyccl.unique_id(), 0, timeout=datetime.timedelta(seconds=-1))


def test_other_arguments_checked_as_before():
    with raises(ValueError, "Communicator: rank 2 is out of range for world_size 2 (ranks are 0..1)"):
        pyccl.Communicator(2, pyccl.unique_id(), 2, timeout=1)
    with raises(TypeError, "Communicator: rank must be an int, got str"):
        pyccl.Communicator(2, pyccl.unique_id(), "0", timeout="bad")


def test_blocking_argument_checked():
    uid = pyccl.unique_id()
    with raises(TypeError, "Communicator: blocking must be True, False or None, got int"):
        pyccl.Communicator(2, uid, 0, timeout=1, blocking=1)
    with raises(ValueError, "Communicator: blocking=False needs a timeout (a non-blocking "
                            "communicator's calls are polled until their deadline); got timeout=None"):
        pyccl.Communicator(2, uid, 0, blocking=False)
    with raises(TypeError, "Communicator() takes at most 5 positional arguments (6 given)"):
        pyccl.Communicator(2, uid, 0, None, 1, True)  # keyword only


def test_backend_communicators_are_blocking(monkeypatch):
    """The "pyccl" backend's communicator: its group's timeout, on a blocking handle."""
    import pyccl.distributed as pd
    seen = []
    monkeypatch.setattr(pd._C, "Communicator", lambda *a, **k: seen.append((a, k)) or "comm")
    monkeypatch.setattr(pd, "need_gpu", lambda what: None)
    assert pd._new_communicator(2, b"u", 1, 600.0, 3) == "comm"
    assert pd._new_communicator(2, b"u", 1, None) == "comm"
    assert seen == [((2, b"u", 1, 3, 600.0), {"blocking": True}),
                    ((2, b"u", 1, None, None), {"blocking": None})]


# ---------------------------------------------------------------- the fake GPU

@pytest.fixture(scope="module")
def fakegpu(tmp_path_factory):
    cc = shlex.split(sysconfig.get_config_var("CC") or "cc")
    if shutil.which(cc[0]) is None:
        pytest.skip(f"no C compiler ({cc[0]}) to build the fake GPU library")
    out = str(tmp_path_factory.mktemp("fakegpu") / "libfakegpu.so")
    src = os.path.join(HERE, "fakegpu", "fakegpu.c")
    r = subprocess.run(cc + ["-shared", "-fPIC", "-O1", "-Wall", "-Wextra", "-Werror", "-o", out, src,
                             "-lpthread", "-lm"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return out


def run_fake(lib, scenario, timeout=60):
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    r = subprocess.run([sys.executable, os.path.join(HERE, "child_fakegpu.py"), lib, scenario],
                       capture_output=True, text=True, timeout=timeout, env=env)
    lines = r.stdout.splitlines()
    results = [json.loads(line[7:]) for line in lines if line.startswith("RESULT ")]
    at_exit = [json.loads(line[8:]) for line in lines if line.startswith("AT_EXIT ")]
    assert r.returncode == 0 and results, f"{scenario} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    assert at_exit and at_exit[0]["misuse"] == 0 and at_exit[0]["concurrent"] == 0, at_exit
    return results[0], at_exit[0]


@pytest.mark.parametrize("scenario", [
    "init_then_collectives",   # non-blocking init polled; collectives tracked; destroy finalizes
    "untimed",                 # no timeout: nothing tracked, no thread; abort() ends a wait
    "graph_capture",           # no event recorded while the stream is captured
    "group_calls",             # events at the group's end; destroy/abort refused inside
    "mixed_group",             # timed and untimed communicators in one group: refused by pyccl
    "split_child",             # the child inherits the timeout; a hung split times out
    "wait_limit_not_aborted",  # wait(timeout=) shorter than the communicator's: not aborted
    "async_error",             # NCCL's asynchronous error aborts it and raises NcclError
    "connect_slow_and_hung",   # ncclInProgress on first use: polled, bounded
    "abort_from_thread",       # abort() from another thread ends a wait() at once
    "drop_in",                 # pyccl.nccl with comms=[timed communicator]
    "two_comms_one_call",      # pyccl.nccl over two watched communicators in one NCCL group
    "threads_share_comm",      # four threads on one communicator: never two inside NCCL
    "threads_share_untimed",   # the same without a timeout: Communicator methods and pyccl.nccl
    "second_device_only",      # the watchdog makes no CUDA context on a device the rank does not use
    "launch_queue_full",       # a launch blocked behind the stuck kernel: aborted after timeout + 1 s
    "lifecycle",               # destroyed on GC and by `with`; 50 create/use/destroy leave nothing
    "names",                   # Communicator.name: unique, found while alive, gone with the object
    "queue_not_queried",       # the caller queries no event below _C._MAX_PENDING unfinished
    "deadline_after_the_work_ahead",  # a call's deadline counts from the end of the one ahead
])
def test_fake_gpu(fakegpu, scenario):
    run_fake(fakegpu, scenario)


# The scenarios whose behaviour a blocking handle keeps (blocking=True with a timeout: the GPU
# work of every call watched).  Not among them: the host-side waits that only a non-blocking
# handle bounds (a hung init, connection, split or group end; a launch stuck behind a full queue,
# which a blocking handle cannot be aborted under).
BOTH_KINDS = ["graph_capture", "mixed_group", "wait_limit_not_aborted", "async_error",
              "abort_from_thread", "drop_in", "two_comms_one_call", "threads_share_comm", "lifecycle",
              "names", "collective_timeout", "watchdog_alone", "back_pressure", "destroy_stuck",
              "exit_with_stuck_work", "blocking_kind", "queue_not_queried",
              "deadline_after_the_work_ahead"]


@pytest.mark.parametrize("scenario", BOTH_KINDS)
def test_fake_gpu_blocking_handle(fakegpu, scenario, monkeypatch):
    monkeypatch.setenv("FAKE_BLOCKING", "1")
    run_fake(fakegpu, scenario)


def test_fake_init_timeout(fakegpu):
    took, at_exit = run_fake(fakegpu, "init_timeout")
    assert 0.5 <= took < 1.5


def test_fake_collective_timeout_then_a_new_communicator(fakegpu):
    took, _ = run_fake(fakegpu, "collective_timeout")
    assert took < 1.0


def test_fake_watchdog_aborts_without_any_call(fakegpu):
    run_fake(fakegpu, "watchdog_alone")


def test_fake_back_pressure(fakegpu):
    enqueued, _ = run_fake(fakegpu, "back_pressure")
    assert enqueued == pyccl._C._MAX_PENDING  # stopped at the bound, not before


def test_fake_destroy_is_bounded(fakegpu):
    took, at_exit = run_fake(fakegpu, "destroy_stuck")
    assert took < 1.0 and at_exit["aborts"] == 1


def test_fake_exit_aborts_unfinished_work(fakegpu):
    _, at_exit = run_fake(fakegpu, "exit_with_stuck_work")
    assert at_exit["aborts"] == 1


def _interrupted(lib, scenario):
    """Run the scenario until it prints WAITING, send SIGINT: (seconds to end, stdout, stderr)."""
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    # SIGINT live in the child even when this runs from a background job (which ignores it)
    p = subprocess.Popen([sys.executable, os.path.join(HERE, "child_fakegpu.py"), lib, scenario],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        t0 = time.monotonic()
        line = ""
        while "WAITING" not in line and time.monotonic() - t0 < 30:
            line = p.stdout.readline()
            if not line and p.poll() is not None:
                break
        assert "WAITING" in line, p.stderr.read()
        time.sleep(0.2)
        sent = time.monotonic()
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=10)
        took = time.monotonic() - sent
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    return took, out, err


def test_fake_sigint_interrupts_wait(fakegpu):
    took, out, err = _interrupted(fakegpu, "sigint_in_wait")
    assert "KeyboardInterrupt" in err, err[-2000:]
    assert "RESULT" not in out
    assert took < 2.0, took
    # the stuck work was aborted on the way out
    assert 'AT_EXIT {"aborts": 1.0, "misuse": 0.0, "concurrent": 0.0}' in out, out


def test_fake_sigint_interrupts_an_untimed_barrier(fakegpu):
    # without a timeout barrier() waits for its one-element all_reduce: Ctrl-C ends it as it
    # ends wait() (before, a stream synchronize ignored SIGINT until the process was killed)
    took, out, err = _interrupted(fakegpu, "sigint_in_barrier")
    assert "KeyboardInterrupt" in err, err[-2000:]
    assert "RESULT" not in out
    assert took < 2.0, took
    # no NCCL call on a dead handle, none overlapping, on the way out
    at_exit = [json.loads(x[len("AT_EXIT "):]) for x in out.splitlines() if x.startswith("AT_EXIT ")]
    assert len(at_exit) == 1 and (at_exit[0]["misuse"], at_exit[0]["concurrent"]) == (0, 0), out


# ---------------------------------------------------------------- shrink

def test_fake_shrink_of_a_working_communicator(tmp_path):
    # with and without a timeout: two shrinks each, the refused arguments never reach NCCL
    assert _fakes.run_stand_in(tmp_path, "shrink_healthy") == {"None": 2, "5.0": 2}


def test_fake_survivors_shrink_a_failed_communicator(tmp_path):
    res = _fakes.run_stand_in(tmp_path, "shrink_after_failure")
    assert 0.3 - 0.02 <= res["wait_s"] < 0.3 + 1.0, res  # the timeout, counted from the enqueue


def test_untimed_nccl_calls_stay_256_ahead_of_a_dead_peer_and_abort_or_ctrl_c_ends_the_wait(fakegpu):
    # a peer dead unseen and no timeout: NCCL's kernel waits for ever; the host must not run
    # on into a full launch queue, where a launch blocks holding the communicator's lock (which
    # abort() from another thread then waits for): at the 16th mark after the stuck call (a
    # mark every 16 calls, the one 16 back waited for) it waits without the lock and the GIL
    res, _ = run_fake(fakegpu, "nccl_untimed_lead")
    # 64 calls, 4 marks, in a ring of 17 events made at the first one, kept while it lives
    assert res["healthy"] == [4, 17] and res["captured"] == 4, res
    assert res["after_destroy"] == 0 and res["events_live"] == 0, res
    # 5 calls before the peer died: the call that waits is the 17th mark, call 272
    ahead = 16 * 17 - 5
    ab, si = res["abort"], res["sigint"]
    assert ab["ahead"] == ahead and si["ahead"] == ahead, res
    assert ab["ticks"] >= 50, res   # this thread ran while the loop's call waited
    assert ab["abort"][1] is None and ab["abort"][0] < 2.0 and ab["ended_after"] < 2.0, res
    assert ab["err"] == [ahead, "RuntimeError", "all_reduce: the communicator (rank 0 of 2) has been aborted"], res
    assert si["err"] == [ahead, "KeyboardInterrupt", ""], res
    assert si["abort"][1] is None and si["abort"][0] < 2.0, res
    # abort() frees the ring when no call waits on it (after Ctrl-C none does); destroy() or
    # garbage collection (its first mark made one) otherwise
    assert si["live_after_abort"] == 0 and ab["live_after_abort"] in (0, 17), res
    assert res["before_gc"] == 17 and res["events_live"] == 0, res


def _groups_until_the_wait(calls_before, per_group, every=16, marks=16):
    """A model of NCCL's marks without a watch: `calls_before` calls went well, then the peer
    dies and groups of `per_group` calls follow; a group's end records a mark when the count of
    calls passes a multiple of `every` and waits for the mark `marks` back, which never comes
    once it was recorded after the dead peer's first call.  The groups made, the one that waits
    included, and the calls in them."""
    ncalls, nmarks = calls_before, calls_before // every
    first_stuck = nmarks    # the first mark recorded after the peer died
    groups = 0
    while True:
        groups += 1
        before, ncalls = ncalls, ncalls + per_group
        if before // every != ncalls // every:
            nmarks += 1
            if nmarks - 1 - marks >= first_stuck:
                return groups, groups * per_group


def test_untimed_nccl_groups_stay_256_calls_ahead_of_a_dead_peer_and_abort_or_ctrl_c_ends_the_wait(fakegpu):
    # the same for a loop of pyccl.group()s: their launch is the group's end (NCCL's
    # ncclGroupEnd, without the communicator's lock, the communicator counted in the group,
    # where abort() refuses it); before the marks, the loop blocked in a launch behind the
    # stand-in's 1024-deep queue and abort() was refused while the group held the communicator
    res, _ = run_fake(fakegpu, "nccl_untimed_group_lead")
    # 30 groups of 3 calls: 90 calls pass 16, 32, 48, 64 and 80; none while captured
    assert res["healthy"] == [5, 17] and res["captured"] == 5 and res["after_destroy"] == 0, res
    groups, calls = _groups_until_the_wait(5, 3)
    assert 16 * 16 <= calls <= 16 * 17 + 3, (groups, calls)
    ab, si = res["abort"], res["sigint"]
    assert ab["ahead"] == calls and si["ahead"] == calls, (res, groups, calls)
    assert ab["ticks"] >= 50, res
    assert ab["abort"][1] is None and ab["abort"][0] < 2.0 and ab["ended_after"] < 2.0, res
    assert ab["err"] == [groups, "RuntimeError", "group end: the communicator (rank 0 of 2) has been aborted"], res
    assert si["err"] == [groups, "KeyboardInterrupt", ""], res
    assert si["abort"][1] is None and si["abort"][0] < 2.0, res
    assert si["live_after_abort"] == 0 and ab["live_after_abort"] in (0, 17), res
    assert res["misuse"] == 0, res


def test_a_communicator_in_another_threads_open_group_refuses_the_call(fakegpu):
    # NCCL takes a communicator's calls from one thread's group at a time, and the group's end
    # works on it without pyccl's lock: a call from another thread meanwhile is refused
    # (nothing enqueued), and works once the group ended; groups on one thread against calls
    # on another never put two threads inside the communicator
    res, _ = run_fake(fakegpu, "group_other_thread")
    for key, rank in (("untimed", 0), ("timed", 0)):
        r = res[key]
        assert r["refused"] == ["RuntimeError", f"all_reduce: the communicator (rank {rank} of 2) is in a "
                                "pyccl.group() open on another thread (NCCL takes a communicator's calls "
                                "from one thread's group at a time); end that group first"], res
        assert r["ops"] == 0, res
        assert r["split"] == ["RuntimeError", f"split: the communicator (rank {rank} of 2) is in a "
                              "pyccl.group() open on another thread (NCCL takes a communicator's calls "
                              "from one thread's group at a time); end that group first"], res
        assert r["splits"] == 0, res
        assert r["shrink"] == ["RuntimeError", f"shrink: the communicator (rank {rank} of 2) is in a "
                               "pyccl.group() open on another thread (NCCL takes a communicator's calls "
                               "from one thread's group at a time); end that group first"], res
        assert r["shrinks"] == 0, res
        assert r["after"] == [None, [2.0], [4.0]], res
        assert r["race"] == {"concurrent": 0, "other_errors": [], "alive": False}, res


def test_watch_costs_times_what_a_timed_call_adds_in_c_and_names_bad_arguments(fakegpu):
    # pyccl.bench --host-breakdown's rows of what a timeout adds per call, without ctypes: each
    # measured `calls` times back to back, the event recorded and queried that many times
    res, _ = run_fake(fakegpu, "watch_costs")
    assert res["names"] == ["cudaGetDevice", "cudaStreamIsCapturing", "cudaEventRecord (timing off)",
                            "cudaEventQuery (finished)", "clock read", "mutex lock and unlock",
                            "GIL released and taken"], res
    assert res["positive"], res
    assert res["counted"] == {"event_records": 300, "event_queries": 300, "stream_syncs": 1,
                              "events_live": 0}, res
    assert res["recorded_while_captured"] == 0, res
    assert res["errors"] == [
        "ValueError: _watch_costs: the stream is being captured into a CUDA graph (the event "
        "records would become nodes of it); measure on a stream that is not",
        "ValueError: _watch_costs: calls must be at least 1, got 0",
        "TypeError: _watch_costs: stream must be an int (a cudaStream_t), got str",
        "TypeError: _watch_costs: calls must be an int, got str",
        "ValueError: _watch_costs: device must be 0 to 1 (the GPUs there are), got 2",
        "TypeError: _watch_costs() takes exactly 3 arguments (2 given)"], res
