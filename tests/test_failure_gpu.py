"""GPU tier: communicators with a timeout when a peer dies, never arrives, or
the job is misconfigured, and ^C while blocked (issue #6); and the same
communicators on healthy peers, results checked exactly.

Each rank is a separate `python child_failure.py ...` process that reports
progress as EVENT lines; the parent decides whom to kill or interrupt and
when, measures the survivors, and kills every child in the end.  Every wait
here is bounded, so a regression fails the test instead of hanging it.
Expected run time: about 2 minutes in all on 2 GPUs.
"""
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest

from conftest import gpu_count, needs_ranks
from _ranks import run_ranks
import _scenarios as sc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHILD = os.path.join(ROOT, "tests", "child_failure.py")
TIMEOUT = 5.0
SLACK = 2.0   # the promise: the survivor raises within TIMEOUT + SLACK

pytestmark = needs_ranks(2)


class Child:
    """One rank as a process; its EVENT lines are read in a thread."""

    def __init__(self, scenario, rank, uid="-", timeout=TIMEOUT, world=2):
        env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1", FAILURE_WORLD=str(world))
        self.rank = rank
        self.p = subprocess.Popen([sys.executable, CHILD, scenario, str(rank), uid, str(timeout)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, env=env)
        self.events = queue.Queue()
        self.lines, self.err = [], []
        threading.Thread(target=self._read_out, daemon=True).start()
        threading.Thread(target=lambda: self.err.extend(self.p.stderr), daemon=True).start()

    def _read_out(self):
        for line in self.p.stdout:
            self.lines.append(line)
            if line.startswith("EVENT "):
                self.events.put(json.loads(line[6:]))
        self.events.put(None)  # end of output

    def output(self):
        time.sleep(0.2)  # let the reader threads catch up
        return (f"--- rank {self.rank} (rc={self.p.poll()}) stdout:\n{''.join(self.lines)[-3000:]}"
                f"\n--- stderr:\n{''.join(self.err)[-5000:]}")

    def expect(self, name, within):
        """The next event, which must be `name`, within `within` seconds."""
        try:
            ev = self.events.get(timeout=within)
        except queue.Empty:
            raise AssertionError(f"rank {self.rank}: no '{name}' within {within} s\n{self.output()}") from None
        assert ev is not None, f"rank {self.rank} ended before '{name}'\n{self.output()}"
        assert ev["name"] == name, f"rank {self.rank}: expected '{name}', got {ev}\n{self.output()}"
        return ev

    def exit_code(self, within):
        try:
            return self.p.wait(timeout=within)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"rank {self.rank} still running after {within} s\n{self.output()}") from None

    def release(self):
        """Let a child that waits on its stdin go on."""
        try:
            self.p.stdin.write("go\n")
            self.p.stdin.flush()
        except OSError:
            pass

    def kill(self):
        if self.p.poll() is None:
            self.p.kill()
        try:
            self.p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass


def pair(scenario, timeout=TIMEOUT):
    r0 = Child(scenario, 0, timeout=timeout)
    try:
        uid = r0.expect("uid", 120)["uid"]
    except BaseException:
        r0.kill()
        raise
    return r0, Child(scenario, 1, uid, timeout=timeout)


def bounded(ev, low=0.0):
    took = ev["took"] if ev.get("took") is not None else None
    assert took is not None and low <= took <= TIMEOUT + SLACK, ev
    return took


@pytest.mark.parametrize("algo", ["nccl", "own"])
def test_peer_killed_mid_loop(algo):
    """(a) SIGKILL rank 1 inside a loop of all_reduces: rank 0 raises within
    timeout + 2 s of the kill, then a fresh communicator works (~25 s).

    What a dead peer becomes (the promise, on every transport): a pyccl.NcclError within
    the timeout plus 2 s, the communicator aborted.  It is an NcclTimeoutError where the
    watchdog notices first (a kernel waiting on a peer over NVLink/PCIe, and always on
    pyccl's own kernels), and an NcclError carrying NCCL's error where NCCL notices first
    (its network transport sees the closed connection: ranks sharing one GPU talk over
    sockets)."""
    r0, r1 = pair("killed_peer_" + algo)
    try:
        r0.expect("looping", 180)
        r1.expect("looping", 60)
        time.sleep(1.0)
        killed = time.time()
        r1.p.send_signal(signal.SIGKILL)
        ev = r0.expect("raised", TIMEOUT + 30)
        delay = ev["t"] - killed
        print(f"\nrank 0 raised {ev['type']} {delay:.2f} s after the kill, after {ev['iters']} "
              f"all_reduces: {ev['msg']}")
        assert ev["is_nccl"] and ev["msg"].endswith("; the communicator was aborted"), ev
        # NcclTimeoutError unless NCCL itself noticed the death first (an
        # NcclError naming NCCL's error, e.g. a network transport's)
        assert ev["is_timeout"] or "NCCL error" in ev["msg"], ev
        if algo == "own":  # a kernel spinning on a dead peer's flags: only the watchdog sees it
            assert ev["is_timeout"], ev
        if ev["is_timeout"]:
            assert f"rank 0 of 2 timed out after {TIMEOUT} s waiting for its peers" in ev["msg"], ev
        assert 0 < delay <= TIMEOUT + SLACK, f"raised {delay:.2f} s after the kill"
        again = r0.expect("raised_again", 30)
        assert again["type"] == ev["type"] and again["msg"].endswith(ev["msg"].split(": ", 1)[1]), again
        r0.expect("recovered", 120)
        r0.expect("done", 30)
        assert r0.exit_code(60) == 0, r0.output()
    finally:
        r0.kill()
        r1.kill()


@pytest.mark.parametrize("case", ["own-killed", "nccl-stopped", "nccl-group-stopped"])
def test_peer_lost_without_timeout_abort_ends_a_loop(case):
    """Rank 0 loops all_reduce on a thread, on a communicator without a timeout, and loses its
    peer: own kernels with rank 1 SIGKILLed, NCCL's with rank 1 SIGSTOPped (its sockets stay
    open, so NCCL sees nothing, as across NVLink between two GPUs), alone or two in each
    pyccl.group().  Rank 0's kernel waits for ever (there is no timeout), but the loop's call
    (or group's end) waits at most 256 launches (own kernels) or 256 calls (NCCL) ahead with
    the GIL and the communicator's lock released, outside any group, so the main thread runs
    on and its abort() ends that wait, which raises that the communicator was aborted."""
    r0, r1 = pair({"own-killed": "killed_peer_untimed_own",
                   "nccl-stopped": "stopped_peer_untimed_nccl",
                   "nccl-group-stopped": "stopped_peer_untimed_nccl_group"}[case])
    try:
        r0.expect("looping", 180)
        r1.expect("looping", 60)
        time.sleep(1.0)
        r1.p.send_signal(signal.SIGKILL if case == "own-killed" else signal.SIGSTOP)
        stuck = r0.expect("stuck", 60)   # the main thread ran while the loop's call waited
        assert stuck["err"] == "None", stuck
        ev = r0.expect("raised", 60)
        unit = "groups of 2 all_reduces" if "group" in case else "all_reduces"
        print(f"\nrank 0's loop stopped after {stuck['iters']} {unit}; abort() ended its "
              f"call in {ev['after_abort']:.2f} s: {ev.get('type')}: {ev.get('msg')}; abort() "
              f"returned after {ev['abort_took']:.2f} s")
        assert not ev["alive"] and ev["iters"] == stuck["iters"], ev
        op = "group end" if "group" in case else "all_reduce"
        assert (ev["type"], ev["msg"]) == ("RuntimeError", f"{op}: the communicator (rank 0 of 2) "
                                                           "has been aborted"), ev
        # the call ends as abort() begins; NCCL's abort itself, with a stopped peer, takes longer
        assert ev["after_abort"] < 5.0 and ev["abort_took"] < 45.0, ev
        r1.kill()
        r0.expect("recovered", 120)
        r0.expect("done", 30)
        assert r0.exit_code(60) == 0, r0.output()
    finally:
        r0.kill()
        r1.kill()


def test_peer_never_arrives():
    """(b) rank 1 stops calling collectives: rank 0's all_reduce, on pyccl's
    own kernels and on NCCL, on a communicator rank 1 never used (cannot
    connect) and on one whose peer stays away (a kernel waiting on the GPU),
    raises within the bound each time (~35 s)."""
    r0, r1 = pair("absent_peer")
    aborted = "; the communicator was aborted"
    waiting = f"rank 0 of 2 timed out after {TIMEOUT} s waiting for its peers"
    expected = {
        # the first qualifying call sets pyccl's kernels up, with every rank
        "unconnected-own": f"all_reduce: {waiting} (setting up pyccl's all-reduce kernels){aborted}",
    }
    # raised by the call, or by wait() for the call that failed; a kernel that gave up
    # waiting says so (the watchdog reads the kernels' word: no event per own-kernel call)
    later = {"unconnected-nccl": waiting + aborted,
             "connected-own": f"{waiting} in pyccl's all-reduce kernel{aborted}",
             "connected-nccl": waiting + aborted}
    try:
        r0.expect("ready", 180)
        r1.expect("ready", 60)
        # the order of child_failure.ABSENT_CASES (not imported: it imports torch)
        for case in ("unconnected-own", "unconnected-nccl", "connected-own", "connected-nccl"):
            ev = r0.expect("raised", TIMEOUT + 30)
            print(f"\n{case}: {ev['type']} from {ev['where']} after {ev['took']:.2f} s: {ev['msg']}")
            assert ev["case"] == case and ev["is_timeout"], ev
            want = expected.get(case)
            if want is not None:
                assert ev["msg"] == want, ev
            else:
                prefix = "wait: all_reduce: " if ev["where"] == "wait" else "all_reduce: "
                assert ev["msg"] == prefix + later[case], ev
            bounded(ev, low=TIMEOUT - 0.5)
        r0.expect("recovered", 120)
        r0.expect("done", 30)
        assert r0.exit_code(60) == 0, r0.output()
    finally:
        r0.kill()
        r1.kill()


def test_wrong_world_size_init_times_out():
    """(c) world_size=3 with 2 processes: both inits give up after the
    timeout with a clear message, and the processes stay usable (~15 s)."""
    r0, r1 = pair("wrong_world_size")
    try:
        for r in (r0, r1):
            ev = r.expect("raised", TIMEOUT + 120)
            print(f"\nrank {r.rank}: {ev['type']} after {ev['took']:.2f} s: {ev['msg']}")
            assert ev["type"] == "NcclTimeoutError", ev
            assert ev["msg"] == (f"Communicator: rank {r.rank} of 3 timed out after {TIMEOUT} s waiting "
                                 "for its peers to join (every rank must call it with the same unique_id "
                                 "and world_size); the communicator was aborted"), ev
            bounded(ev, low=TIMEOUT - 0.5)
        for r in (r0, r1):
            r.release()  # rank 0 hosts the rendezvous: it stays until both gave up
        for r in (r0, r1):
            r.expect("recovered", 120)
            r.expect("done", 30)
            assert r.exit_code(60) == 0, r.output()
    finally:
        r0.kill()
        r1.kill()


def test_sigint_while_blocked_in_wait():
    """(d) SIGINT to a process blocked in comm.wait() on work its peer never
    joins: KeyboardInterrupt, and the process exits promptly (~15 s)."""
    r0, r1 = pair("sigint_in_wait", timeout=60.0)
    try:
        r1.expect("ready", 180)
        r0.expect("waiting", 60)
        time.sleep(1.0)
        sent = time.time()
        r0.p.send_signal(signal.SIGINT)
        rc = r0.exit_code(15)
        took = time.time() - sent
        time.sleep(0.2)  # the stderr reader
        err = "".join(r0.err)
        print(f"\nrank 0 exited with {rc} {took:.2f} s after SIGINT")
        assert "KeyboardInterrupt" in err, r0.output()
        assert "no_error" not in "".join(r0.lines), r0.output()
        assert rc != 0 and took < 10, (rc, took)
    finally:
        r0.kill()
        r1.kill()


def _with_uid(fn):
    import pyccl

    return run_ranks(fn, max(2, gpu_count()), pyccl.unique_id(), make_comm=False, timeout=180)


def test_timed_communicator_on_healthy_peers():
    """Every path of a communicator with a timeout computes as without (~20 s)."""
    assert set(_with_uid(sc.timed_collectives).values()) == {"ok"}


def test_timed_communicator_in_cuda_graph():
    """A capture on a watched communicator: not tracked, not broken (~15 s)."""
    assert set(_with_uid(sc.timed_graph_capture).values()) == {"ok"}


@needs_ranks(4)
def test_survivors_shrink_and_finish_after_one_of_4_is_killed():
    """SIGKILL rank 3 of 4 inside a loop of own-kernel all_reduces: ranks 0-2 raise within
    timeout + 2 s of the kill, shrink() the failed communicator to the 3 of them (its handle
    was revoked, not aborted), and finish the loop there, bitwise; no region is left parked."""
    world = 4
    kids = [Child("survivors_shrink", 0, timeout=TIMEOUT, world=world)]
    try:
        uid = kids[0].expect("uid", 120)["uid"]
        kids += [Child("survivors_shrink", r, uid, timeout=TIMEOUT, world=world) for r in range(1, world)]
        for k in kids:
            ev = k.expect("looping", 240)
            assert ev["state"] == "ready", ev  # the own kernels run (ranks share GPUs where few)
        time.sleep(0.5)
        killed = time.time()
        kids[-1].p.send_signal(signal.SIGKILL)
        for k in kids[:-1]:
            ev = k.expect("raised", TIMEOUT + 30)
            delay = ev["t"] - killed
            print(f"\nrank {k.rank} raised {ev['type']} {delay:.2f} s after the kill: {ev['msg']}")
            assert ev["is_nccl"] and delay <= TIMEOUT + SLACK, (delay, ev)
        for k in kids[:-1]:
            ev = k.expect("shrunk", TIMEOUT + 60)
            print(f"rank {k.rank}: shrink() took {ev['took']:.2f} s -> rank {ev['rank']} of {ev['size']}")
            assert (ev["rank"], ev["size"]) == (k.rank, world - 1) and ev["took"] < TIMEOUT + SLACK, ev
        for k in kids[:-1]:
            ev = k.expect("finished", 240)
            assert ev["iters"] == 600 and ev["shrunk"] == 1 and ev["state"] == "ready", ev
            assert ev["parked"] == 0, ev
            k.expect("done", 60)
            assert k.exit_code(60) == 0, k.output()
    finally:
        for k in kids:
            k.kill()
