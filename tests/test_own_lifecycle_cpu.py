"""pyccl's own all-reduce kernels when things go wrong around them, on the CPU.

Two processes, one per rank, against the stand-in GPU library built with FAKE_PEER_MEMORY
(see tests/test_selection_cpu.py), whose `peer_dead` now also models a dead peer for the
ranks-as-processes build: NCCL work sticks on its stream (with `launch_block`, the next
launch blocks behind it), and an own all-reduce kernel waits on its stream until its stop
word is set or its own timeout passes.  The scenarios are tests/child_fakegpu.py's
"own kernels: lifecycle under failure"; each process ends itself with every thread's
traceback when it hangs, and is killed past the limit here.
"""

import pytest

import _fakes
import pyccl


if not pyccl._C._ar_built():
    pytest.skip("pyccl was built without nvcc: no own kernels to test", allow_module_level=True)


@pytest.fixture(scope="module")
def peer_lib(tmp_path_factory):
    return _fakes.peer_library(tmp_path_factory)


def run_ranks(lib, scenario, tmp_path, case=None, limit=60, **extra_env):
    """Both ranks' RESULT of `scenario` (FAKE_CASE=case), 1 MiB buffers, quiet; a rank that
    failed or did not end within `limit` s fails the test with its last steps and output."""
    env = dict(PYCCL_QUIET="1", PYCCL_AR_BUFFER_MB="1", **({"FAKE_CASE": case} if case else {}))
    env.update(extra_env)
    return [res for res, _ in _fakes.run_rank_pair(
        lib, scenario, tmp_path, limit, ("PYCCL_AR_TIMEOUT", "PYCCL_DISABLE_OWN_KERNELS"), **env)]


# 3. The own kernels' set-up talks to NCCL under the communicator's lock; with the stream
# stuck behind a dead peer its NCCL call blocks in the launch, and nothing may hang there:
# the watchdog gives up on it as on any call, and abort() gets through.

@pytest.mark.parametrize("algo", ["nccl", "auto"])
def test_first_call_behind_a_stuck_stream_times_out(peer_lib, tmp_path, algo):
    # 'nccl' holds today (the call is watched); 'auto' sets the own kernels up first
    for rank, res in enumerate(run_ranks(peer_lib, "own_setup_behind_stuck_stream", tmp_path, algo)):
        assert res["err"][0] == "NcclTimeoutError", res
        assert res["err"][1].startswith(f"all_reduce: rank {rank} of 2 timed out after 2.0 s waiting for "
                                        "its peers"), res
        assert res["dt"] < 2.0 + 2.0, res
        assert res["misuse"] == 0, res


def test_set_up_past_ar_timeout_fails_a_communicator_without_timeout(peer_lib, tmp_path):
    # no watch: the set-up's bound is PYCCL_AR_TIMEOUT; the door fails the communicator (a
    # record of the failure made for it) and raises, and every later call raises the same
    for rank, res in enumerate(run_ranks(peer_lib, "own_setup_behind_stuck_stream", tmp_path, "untimed",
                                         PYCCL_AR_TIMEOUT="2")):
        msg = (f"all_reduce: rank {rank} of 2 timed out after 2.0 s waiting for its peers (setting up "
               "pyccl's all-reduce kernels); the communicator was aborted")
        assert res["err"] == ["NcclTimeoutError", msg], res
        assert 2.0 <= res["dt"] < 2.0 + 2.0, res
        assert res["next"] == ["NcclTimeoutError", msg], res
        assert res["state"] == "off", res
        assert res["misuse"] == 0, res


def test_abort_from_another_thread_ends_a_stuck_set_up(peer_lib, tmp_path):
    # abort() comes 0.5 s into the set-up: it gets through by itself, not only once the
    # watchdog gave up on the stuck call (the timeout + 1 s after the call began)
    for res in run_ranks(peer_lib, "own_setup_behind_stuck_stream", tmp_path, "abort"):
        abort_dt, abort_err = res["abort"]
        assert abort_err is None and abort_dt < 2.0, res
        # the set-up's call ends too: aborted, or timed out if the watchdog came first
        assert res["err"] is not None and res["err"][0] in ("RuntimeError", "NcclTimeoutError"), res
        assert res["dt"] < 2.0 + 2.0, res
        assert res["misuse"] == 0, res


def test_destroy_barrier_behind_a_stuck_stream_is_bounded(peer_lib, tmp_path):
    for res in run_ranks(peer_lib, "own_setup_behind_stuck_stream", tmp_path, "destroy"):
        assert res["err"] is None or res["err"][0] == "NcclTimeoutError", res
        assert res["dt"] < 2.0 + 2.0, res
        assert res["misuse"] == 0, res


# 5. A refused abort() changes nothing: not even the own kernels' stop word.

@pytest.mark.parametrize("case", ["timed", "untimed"])
def test_refused_abort_leaves_the_own_kernels_working(peer_lib, tmp_path, case):
    for rank, res in enumerate(run_ranks(peer_lib, "own_abort_refused_in_group", tmp_path, case)):
        assert res["refused"] == [
            "RuntimeError", f"abort: the communicator (rank {rank} of 2) was used inside a pyccl.group() "
            "that has not ended; end the group first"], res
        assert res["group_end"] is None, res
        assert res["after"] is None and res["values"] == [3.0, 4.0, 9.0], res
        assert res["state"] == "ready" and res["launches"] == 1, res
        assert res["misuse"] == 0, res


# 6. abort() is what ends a wait on a dead peer, on a communicator without a timeout:
# destroy() waiting for the own kernels too.

def test_abort_ends_a_destroy_waiting_for_a_stuck_own_kernel(peer_lib, tmp_path):
    for res in run_ranks(peer_lib, "own_kernel_stuck_untimed", tmp_path, "abort_during_destroy"):
        assert res["abort"] != "not returned" and res["abort"][1] is None and res["abort"][0] < 2.0, res
        assert res["destroy"][1] is None, res
        assert res["destroy_after_abort"] is not None and res["destroy_after_abort"] < 5.0, res
        assert res["misuse"] == 0, res   # the stop word was not freed under the kernel


def test_abort_then_destroy_with_a_stuck_own_kernel(peer_lib, tmp_path):
    for res in run_ranks(peer_lib, "own_kernel_stuck_untimed", tmp_path, "abort_then_destroy"):
        assert res["abort"][1] is None and res["abort"][0] < 2.0, res
        assert res["destroy"][1] is None and res["destroy"][0] < 2.0, res
        assert res["misuse"] == 0, res


@pytest.mark.parametrize("case", ["untimed", "timed"])
def test_a_wait_that_abort_ended_says_so_though_the_kernel_stopped_first(peer_lib, tmp_path, case):
    # the stop word ends the kernel before the abort marks the communicator (NCCL's abort
    # takes long): the wait does not return as if the work had finished
    for rank, res in enumerate(run_ranks(peer_lib, "own_kernel_stuck_abort_wait", tmp_path, case)):
        assert res["wait"][1] == ["RuntimeError", f"wait: the communicator (rank {rank} of 2) has been aborted"], res
        assert 0.7 <= res["wait"][0] < 3.0, res
        assert res["abort"] != "not returned" and res["abort"][1] is None, res
        assert res["destroyed"] and res["misuse"] == 0, res


# A communicator with a timeout watches its own kernels' work as it watches NCCL's: a kernel
# stuck on a dead peer fails the communicator once the timeout passed.

def test_a_stuck_own_kernel_is_watched_on_a_timed_communicator(peer_lib, tmp_path):
    for rank, res in enumerate(run_ranks(peer_lib, "own_kernel_stuck_timed", tmp_path)):
        msg = (f"all_reduce: rank {rank} of 2 timed out after 2.0 s waiting for its peers in "
               "pyccl's all-reduce kernel; the communicator was aborted")
        dt, err = res["wait"]
        assert err == ["NcclTimeoutError", "wait: " + msg], res
        # the kernel's own deadline: the timeout
        assert 2.0 <= dt < 2.0 + 0.9, res
        assert res["next"][1] == ["NcclTimeoutError", msg], res
        assert res["misuse"] == 0, res


def test_own_kernels_on_a_timed_communicator_record_no_event(peer_lib, tmp_path):
    # their waits on peers are bounded by the timeout: the watchdog reads the kernels' word
    # and fails the communicator when one gave up, with no event (how far the host runs ahead
    # is bounded by a word the kernels store) and no call looking
    for rank, res in enumerate(run_ranks(peer_lib, "own_kernel_timed_unevented", tmp_path, "gave_up")):
        assert res["records"] == 0, res
        assert res["sums"] == [[2.0 * i + 3.0, -4.5] for i in range(20)], res
        assert res["wait_records"] == 1, res   # wait()'s own, on the stream the calls used
        msg = (f"all_reduce: rank {rank} of 2 timed out after 2.0 s waiting for its peers in "
               "pyccl's all-reduce kernel; the communicator was aborted")
        dt, kind, text = res["async"]
        assert (kind, text) == ("NcclTimeoutError", "get_async_error: " + msg), res
        assert 2.0 <= dt < 2.0 + 0.9, res
        assert res["next"] == ["NcclTimeoutError", msg], res
        assert res["misuse"] == 0, res


def test_the_host_stays_a_bounded_number_of_own_kernels_ahead(peer_lib, tmp_path):
    # with no event, the mark every 16th launch's kernel stores as it ends bounds how far the
    # host runs ahead of a kernel stuck on a dead peer (16 x 16 launches, as 256 pending
    # events bound NCCL calls), the GIL released while it waits
    for rank, res in enumerate(run_ranks(peer_lib, "own_kernel_timed_lead", tmp_path)):
        # the set-up's call was the first: the 17th mark is the loop's 271st call
        assert res["ahead"] == 16 * 17 - 1, res
        assert res["ticks"] >= 50, res
        n, kind, text = res["err"]
        assert n == 16 * 17 - 1 and kind == "NcclTimeoutError", res
        assert text == (f"all_reduce: rank {rank} of 2 timed out after 2.0 s waiting for its peers in "
                        "pyccl's all-reduce kernel; the communicator was aborted"), res
        assert 2.0 <= res["dt"] < 2.0 + 1.5, res
        assert res["misuse"] == 0, res


@pytest.mark.parametrize("case", ["abort", "sigint"])
def test_without_timeout_the_host_stays_as_far_ahead_and_abort_or_ctrl_c_ends_its_wait(peer_lib, tmp_path, case):
    # a dead peer and no timeout: the kernels wait for ever, as NCCL's would, but the host
    # does not run on into a full launch queue (where a launch blocks holding the GIL, so
    # that neither abort() from another thread nor Ctrl-C could end it): it waits 16 x 16
    # launches ahead, the GIL released
    for rank, res in enumerate(run_ranks(peer_lib, "own_kernel_untimed_lead", tmp_path, case)):
        assert res["ahead"] == 16 * 17 - 1, res
        assert res["abort"][1] is None and res["abort"][0] < 2.0, res
        if case == "abort":
            assert res["ticks"] >= 50, res   # this thread ran while the loop's call waited
            assert res["err"] == [16 * 17 - 1, "RuntimeError",
                                  f"all_reduce: the communicator (rank {rank} of 2) has been aborted"], res
            assert res["ended_after"] < 2.0, res
        else:
            assert res["err"] == [16 * 17 - 1, "KeyboardInterrupt", ""], res
        assert res["misuse"] == 0, res


def test_a_timed_communicator_that_fails_stops_its_waiting_own_kernels(peer_lib, tmp_path):
    # an NCCL error fails the communicator while an own kernel waits for a dead peer: the
    # kernel stops then (its stop word), not at its own deadline 2 s later
    for rank, res in enumerate(run_ranks(peer_lib, "own_kernel_timed_unevented", tmp_path, "nccl_error")):
        dt, kind, text = res["async"]
        assert kind == "NcclError" and dt < 1.0, res
        assert text == (f"get_async_error: watchdog: rank {rank} of 2: NCCL error 2 (unknown result "
                        "code) while its work ran; the communicator was aborted"), res
        destroy_dt, err = res["destroy"]
        assert err is None and destroy_dt < 1.0, res
        assert res["misuse"] == 0, res


# 7a. The communicator destroyed or aborted by the arguments' own Python code while the
# first all_reduce reads them: nothing of the own kernels is made (or kept).

@pytest.mark.parametrize("end", ["destroy", "abort"])
def test_communicator_gone_while_reading_arguments_keeps_no_region(peer_lib, tmp_path, end):
    past = "destroyed" if end == "destroy" else "aborted"
    for rank, res in enumerate(run_ranks(peer_lib, "own_setup_comm_gone_while_reading", tmp_path, end)):
        msg = ["RuntimeError", f"all_reduce: the communicator (rank {rank} of 2) has been {past}"]
        # [what the call raised, [device bytes, peer mappings, host words] left by it]
        assert res == {"tensor, timeout=None": [msg, [0, 0, 0]], "tensor, timeout=5.0": [msg, [0, 0, 0]],
                       "stream, timeout=None": [msg, [0, 0, 0]], "stream, timeout=5.0": [msg, [0, 0, 0]],
                       "misuse": 0}, res


# 7b. The first all_reduce on a communicator that another thread's open pyccl.group() holds:
# the set-up's NCCL calls would go beside that group (whose end holds no lock of pyccl's), so
# the call is refused before anything is sent, and the kernels are set up by a later call.

def test_own_kernel_setup_on_a_communicator_in_another_threads_group_is_refused(peer_lib, tmp_path):
    for rank, res in enumerate(run_ranks(peer_lib, "own_setup_other_group", tmp_path)):
        for timeout in ("None", "5.0"):
            r = res[f"timeout={timeout}"]
            assert r["refused"] == ["RuntimeError", f"all_reduce: the communicator (rank {rank} of 2) is "
                                    "in a pyccl.group() open on another thread (NCCL takes a "
                                    "communicator's calls from one thread's group at a time); end that "
                                    "group first"], res
            # [device bytes, peer mappings, host words, NCCL ops, kernel launches] of the refusal
            assert r["left"] == [0, 0, 0, 0, 0], res
            assert r["values"] == [1.0 + rank, 2.0, 3.0 * (rank + 1)] and r["state"] == "not set up", res
            assert r["after"] == [None, [3.0, 4.0, 9.0], "ready"], res
        assert res["misuse"] == 0, res


# 7c. PYCCL_AR_TIMEOUT is checked, not read with atof(); a value that cannot be used, on every
# rank or on one alone, turns the own kernels off for all (NCCL's all_reduce, the reason in
# all_reduce_info) instead of one rank raising while its peer waits in the set-up; blank is unset.

@pytest.mark.parametrize("where", ["both", "rank0"])
@pytest.mark.parametrize("value", ["-1", "inf", "nan", "abc"])
def test_bad_ar_timeout_turns_the_kernels_off_on_every_rank(peer_lib, tmp_path, value, where):
    bad = f"PYCCL_AR_TIMEOUT must be a finite number of seconds > 0, got '{value}'"
    for rank, res in enumerate(run_ranks(peer_lib, "own_bad_ar_timeout", tmp_path, case=where,
                                         PYCCL_AR_TIMEOUT=value)):
        assert res["first"] is None and res["first_values"] == [3.0, 4.0, 9.0], res
        assert res["state"] == "off", res
        # the rank with the setting names it; a peer names that rank
        assert res["reason"] == (bad if rank == 0 or where == "both" else "rank 0 cannot use them"), res
        assert res["nccl"] is None and res["values"] == [3.0, 4.0, 9.0], res
        assert res["misuse"] == 0, res


def test_ar_timeout_on_one_rank_only_turns_the_kernels_off_on_every_rank(peer_lib, tmp_path):
    # a valid value on rank 0 alone: rank 0's kernels would give up on a late peer and abort,
    # and rank 1's, waiting for ever, would be left waiting by it; the set-up finds the ranks
    # disagree and every rank uses NCCL (no bound on either: nothing gives up)
    why = ("ranks disagree on whether a kernel's wait for its peers ends (rank 0: after 0.5 s, "
           "rank 1: never; PYCCL_AR_TIMEOUT, or timeout=, on some ranks only)")
    (tmp_path / "one").mkdir()
    (tmp_path / "every").mkdir()
    for rank, res in enumerate(run_ranks(peer_lib, "own_bad_ar_timeout", tmp_path / "one", case="rank0",
                                         PYCCL_AR_TIMEOUT="0.5")):
        assert res["first"] is None and res["first_values"] == [3.0, 4.0, 9.0], res
        assert (res["state"], res["reason"]) == ("off", why), res
        assert res["nccl"] is None and res["values"] == [3.0, 4.0, 9.0], res
        assert res["misuse"] == 0, res
    # on every rank: agreed, the kernels set up with that bound
    for res in run_ranks(peer_lib, "own_bad_ar_timeout", tmp_path / "every", case="both",
                         PYCCL_AR_TIMEOUT="0.5"):
        assert (res["state"], res["timeout"]) == ("ready", 0.5), res
        assert res["first_values"] == [3.0, 4.0, 9.0] and res["misuse"] == 0, res


@pytest.mark.parametrize("name, value, lo, hi", [
    ("PYCCL_AR_BUFFER_MB", "16MB", 1, 4096), ("PYCCL_AR_BLOCKS", "0", 1, 64),
    ("PYCCL_AR_THREADS", "1e3", 32, 512), ("PYCCL_AR_LL_MAX", "-16", 0, 1 << 24),
    ("PYCCL_AR_ONESHOT_MAX", "99999999999999999999", 0, 1 << 40), ("PYCCL_AR_PDL", "yes", 0, 1)])
def test_a_bad_kernel_setting_on_one_rank_turns_the_kernels_off_on_every_rank(peer_lib, tmp_path, name, value,
                                                                                lo, hi):
    # not a whole number in its range (before: the default, silently): the rank with it
    # names it, the peer names that rank, every rank uses NCCL
    bad = f"{name} must be a whole number from {lo} to {hi}, got '{value}'"
    for rank, res in enumerate(run_ranks(peer_lib, "own_bad_ar_timeout", tmp_path, case="rank0",
                                         FAKE_VAR=name, **{name: value})):
        assert res["first"] is None and res["first_values"] == [3.0, 4.0, 9.0], res
        assert (res["state"], res["reason"]) == ("off", bad if rank == 0 else "rank 0 cannot use them"), res
        assert res["nccl"] is None and res["values"] == [3.0, 4.0, 9.0], res
        assert res["misuse"] == 0, res


def test_blank_ar_timeout_is_unset(peer_lib, tmp_path):
    for res in run_ranks(peer_lib, "own_bad_ar_timeout", tmp_path, PYCCL_AR_TIMEOUT=""):
        assert res["first"] is None and res["first_values"] == [3.0, 4.0, 9.0], res
        assert res["state"] == "ready" and res["timeout"] == 0.0, res  # 0: no deadline
        assert res["misuse"] == 0, res
