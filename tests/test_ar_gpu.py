"""GPU tier of pyccl's own all-reduce kernels (csrc/kernels/allreduce.cu).

2 processes (or every GPU of the machine, up to 8), on the machine's GPUs round-robin (they
share one where ranks outnumber GPUs, with PYCCL_AR_SHARED_GPU); each scenario in _ar.py checks
its own results bitwise and the parent checks what they return.
"""
import os
import shutil
import subprocess
import sys

import pytest
import torch

import _ar as fa
import _scenarios as sc
from _ranks import _kill_group, run_ranks
from conftest import gpu_count, needs_ranks

W = max(2, min(gpu_count(), 8))
HERE = os.path.dirname(os.path.abspath(__file__))


needs_kernels = pytest.mark.skipif(
    not __import__("pyccl")._C._ar_built(), reason="pyccl was built without nvcc: no own kernels")


@needs_ranks(2)
@needs_kernels
@pytest.mark.parametrize("ll_max", ["default", "0"])
def test_exact_every_dtype_op_size_alignment(ll_max):
    # default: one-shot sizes up to 256 KiB take the LL kernel; 0: never
    env = {} if ll_max == "default" else {"PYCCL_AR_LL_MAX": ll_max}
    res = run_ranks(fa.exact, W, timeout=400, env=env)
    for r in range(W):
        checks, info = res[r]
        assert checks == len(fa.DTYPES) * len(fa.OPS) * len(fa.COUNTS) * 2 * 3
        assert info["state"] == "ready", info


@needs_ranks(2)
@needs_kernels
def test_random_data_float64_reference_and_same_bits_everywhere():
    res = run_ranks(fa.random_data, W)
    assert len(res[0]) == 3 * 2 * 3


@needs_ranks(3)
@needs_kernels
def test_rank_order_and_float32_accumulation_bitwise():
    # At 2 ranks a+b is rounded once whatever the order or the accumulator: only 3+
    # ranks can show a reversed rank order or 16-bit accumulation.
    res = run_ranks(fa.order_and_accumulation, max(3, W))
    assert all(n == 12 for n in res.values()), res


@needs_ranks(2)
@needs_kernels
@pytest.mark.parametrize("ll_max", ["default", "0"])
def test_10000_calls_across_the_epoch_wrap(ll_max):
    env = {} if ll_max == "default" else {"PYCCL_AR_LL_MAX": ll_max}
    res = run_ranks(fa.many_calls, W, env=env)
    start, end = res[0]
    assert start > end  # it wrapped


@needs_ranks(2)
@needs_kernels
@pytest.mark.parametrize("ll_max", ["default", "0"])
def test_blocks_started_late_still_exact(ll_max):
    # each block of every call starts blockIdx * 3 us late (PYCCL_AR_DEBUG_SKEW_NS): a
    # block reading what another block copies in, unsynchronized, gets stale data
    env = {"PYCCL_AR_DEBUG_SKEW_NS": "3000"}
    if ll_max != "default":
        env["PYCCL_AR_LL_MAX"] = ll_max
    res = run_ranks(fa.skewed, W, env=env)
    for r in range(W):
        checks, info = res[r]
        assert checks == 3 * 4 * 2 * 4
        assert info["state"] == "ready", info


@needs_ranks(2)
@needs_kernels
def test_cuda_graph_capture_and_replay():
    res = run_ranks(fa.graphs, W)
    assert all(res[r] == 50 for r in range(W))


@needs_ranks(2)
@needs_kernels
def test_a_call_on_another_stream_waits_for_the_previous_one():
    res = run_ranks(fa.two_streams, W)
    assert all(n == 2 for n in res.values()), res


@needs_ranks(2)
@needs_kernels
@pytest.mark.parametrize("pdl", ["default", "0", "default-skewed"])
def test_chained_calls_read_what_the_call_before_wrote(pdl):
    # default: programmatic dependent launch wherever the GPU has it (compute capability 9.0+).
    # skewed: block b of every call starts b * 20 us late, after launch_dependents, so the
    # next call is resident long before this one ends: without griddepcontrol.wait it reads
    # this call's epoch counter and input unwritten, every time rather than by chance.
    env = {"default": {}, "0": {"PYCCL_AR_PDL": "0"},
           "default-skewed": {"PYCCL_AR_DEBUG_SKEW_NS": "20000"}}[pdl]
    res = run_ranks(fa.chained, W, env=env)
    want_pdl = pdl != "0" and torch.cuda.get_device_capability(0)[0] >= 9
    for r in range(W):
        info, checks = res[r]
        assert checks == 4 and info["state"] == "ready", info
        assert info["pdl"] is want_pdl, info


@needs_ranks(2)
@needs_kernels
def test_disabled_on_one_rank_means_nccl_everywhere():
    res = run_ranks(fa.off_on_one_rank, W, env={"PYCCL_QUIET": "1"})
    assert res[W - 1][0] == "PYCCL_DISABLE_OWN_KERNELS is set"
    assert res[0][0] == f"rank {W - 1} cannot use them"


@needs_ranks(2)
@needs_kernels
@pytest.mark.parametrize("first_bytes", [400, 4096])
def test_thresholds_that_differ_between_ranks_mean_nccl_everywhere(first_bytes):
    # otherwise one rank would run its own kernel and another NCCL for the same call: a
    # hang.  4096: over the last rank's thresholds, under the others' (the set-up must
    # still start on every rank)
    settings = {"PYCCL_AR_ONESHOT_MAX": "1024", "PYCCL_AR_TWOSHOT_MAX": "1024"}
    res = run_ranks(fa.off_on_one_rank, W, settings, first_bytes // 4, env={"PYCCL_QUIET": "1"})
    one, two = res[0][2]["oneshot_max"], res[0][2]["twoshot_max"]
    assert one > first_bytes and two > first_bytes, res[0][2]
    for r in range(W):
        assert res[r][0] == (f"ranks disagree on PYCCL_AR_ONESHOT_MAX / PYCCL_AR_TWOSHOT_MAX "
                             f"(rank {W - 1}: 1024 / 1024 bytes, rank 0: {one} / {two})"), res[r]


@needs_ranks(2)
@needs_kernels
def test_first_call_over_the_buffer_still_sets_up():
    res = run_ranks(fa.first_call_nccl_sized, W, env={"PYCCL_AR_BUFFER_MB": "1"})
    for r in range(W):
        info, before, after = res[r]
        assert info["state"] == "ready" and info["buffer_bytes"] == 1 << 20, info
        assert after == (before + 1) % (1 << 32), (before, after)  # the small call was own


@needs_ranks(2)
@needs_kernels
def test_algo_argument_errors_then_working_calls():
    res = run_ranks(fa.errors, W)
    assert res[0] == ["ValueError", "TypeError", "ValueError", "ValueError", "ValueError",
                      "group"]


@needs_ranks(2)
@needs_kernels
def test_all_gather_and_reduce_scatter_oneshot_bitwise_against_nccl():
    res = run_ranks(fa.gather_scatter, W, env={"PYCCL_AR_BUFFER_MB": "1"})
    assert all(res[r] == 5 * 5 * 3 + 4 * 3 * 5 * 3 for r in range(W)), res


@needs_ranks(2)
@needs_kernels
def test_calls_above_the_buffer_run_in_chunks_bitwise():
    res = run_ranks(fa.chunked, W, env={"PYCCL_AR_BUFFER_MB": "1"})
    assert all(res[r] == (4 * 3 * 2 * 12, 1 << 20) for r in range(W)), res


@needs_ranks(2)
@needs_kernels
def test_all_reduce_coalesced():
    msgs = run_ranks(fa.coalesced, W)[0]
    assert len(msgs) == 3, msgs
    assert msgs[1] == "all_reduce_coalesced: tensors must be a list or tuple of tensors, got Tensor"
    assert msgs[2] == "all_reduce_coalesced: tensors[1] must be a torch.Tensor, got int"
    assert msgs[0] == ("all_reduce_coalesced: tensors[1] has dtype torch.float64 but tensors[0] "
                       "has torch.float32")


@needs_ranks(2)
@needs_kernels
def test_destroy_after_own_kernels():
    # destroy() after a collective set-up frees this rank's region (cudaFree after every
    # peer closed its mapping): at least that much comes back, less 1 MiB of slack
    for r, (before, after, region) in run_ranks(fa.destroy_collective, W).items():
        assert region >= 2 << 20, (r, region)
        assert after - before >= region - (1 << 20), \
            f"rank {r}: destroy() gave back {(after - before) / 2**20:.1f} MiB, the region is {region / 2**20:.1f} MiB"


@needs_ranks(2)
@needs_kernels
@pytest.mark.skipif(shutil.which("compute-sanitizer") is None, reason="compute-sanitizer not found")
@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
def test_compute_sanitizer_clean(tool, tmp_path):
    import pyccl
    uid = pyccl.unique_id().hex()
    env = dict(os.environ, PYTHONPATH=os.path.dirname(HERE) + os.pathsep + HERE)
    procs = [subprocess.Popen(
        ["compute-sanitizer", "--tool", tool, "--error-exitcode", "9", "--target-processes", "all",
         "--report-api-errors", "no",
         sys.executable, os.path.join(HERE, "child_ar.py"), str(r), "2", uid],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        start_new_session=True) for r in range(2)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=300)[0])
    finally:
        for p in procs:  # the sanitizer and the python under it: the whole group
            if p.poll() is None:
                _kill_group(p.pid)
                p.wait(10)
    for r, (p, out) in enumerate(zip(procs, outs)):
        (tmp_path / f"rank{r}.txt").write_text(out)
        assert p.returncode == 0 and "AR CHILD OK" in out, f"rank {r} rc={p.returncode}:\n{out[-3000:]}"
        # API errors are NCCL's own probing of kernel images (cudaFuncGetAttributes at init);
        # what counts here is device-side memory and shared-memory race reports
        assert "ERROR SUMMARY: 0 errors" in out or "RACECHECK SUMMARY: 0 hazards" in out, out[-3000:]


@needs_ranks(2)
@needs_kernels
def test_few_blocks_and_threads_still_bitwise():
    # non-default PYCCL_AR_BLOCKS / PYCCL_AR_THREADS: more vectors per thread, other strides
    res = run_ranks(fa.random_data, W, env={"PYCCL_AR_BLOCKS": "3", "PYCCL_AR_THREADS": "96"})
    assert len(res[0]) == 3 * 2 * 3


@needs_ranks(2)
@needs_kernels
def test_own_kernel_gives_up_after_pyccl_ar_timeout(tmp_path):
    res = run_ranks(fa.own_give_up, 2, str(tmp_path / "flag"), env={"PYCCL_AR_TIMEOUT": "3"}, timeout=180)
    dt, err = res[0]
    assert 2.5 <= dt <= 15, (dt, err)


@needs_ranks(2)
@needs_kernels
def test_device_memory_back_after_10_communicators():
    # with and without a timeout (before, a communicator with one kept its region: 34 MiB
    # each at 2 ranks); NCCL's own memory included, within 1 MiB per communicator
    for r, (before, after) in run_ranks(fa.ten_communicators, W, timeout=300).items():
        assert before - after <= 10 << 20, \
            f"rank {r}: 10 communicators kept {(before - after) / 2**20:.1f} MiB"


@needs_ranks(4)
@needs_kernels
@pytest.mark.parametrize("world", [3, 4])
def test_three_and_four_ranks_random_data_bitwise(world):
    res = run_ranks(fa.random_data, world, timeout=300)
    assert all(len(v) == 3 * 2 * 3 for v in res.values()), res


@needs_ranks(2)
@needs_kernels
def test_recreated_communicators_first_call_with_a_late_rank():
    assert set(run_ranks(fa.recreated_late_first_call, W, timeout=300).values()) == {3}


@needs_ranks(2)
@needs_kernels
def test_abort_from_another_thread_stops_a_waiting_own_kernel(tmp_path):
    res = run_ranks(sc.abort_untimed_from_thread, 2, str(tmp_path / "flag"), "oneshot", timeout=180)
    dt, err, destroyed = res[0]
    assert 0.9 <= dt < 20 and destroyed, (dt, err, destroyed)
    assert err == "RuntimeError: wait: the communicator (rank 0 of 2) has been aborted", err


@needs_ranks(4)
@needs_kernels
@pytest.mark.parametrize("world", [2, 4])
def test_every_byte_back_after_100_abort_or_destroy_cycles(world):
    """A program that recovers 100 times (half by abort(), half by destroy()) keeps at most
    one region per rank: the release handshake frees an aborted communicator's region once
    its peers closed their mappings.  Device memory is the GPU's: where ranks share it,
    every rank's counts."""
    res = run_ranks(fa.recovery_cycles, world, timeout=500)
    sharing = world if gpu_count() < world else 1
    for r, (before, after, region, parked, cycles) in res.items():
        kept = before - after
        print(f"\nrank {r} of {world}: {cycles} cycles, free before {before / 2**20:.1f} MiB, "
              f"after {after / 2**20:.1f} MiB, kept {kept / 2**20:.1f} MiB, "
              f"region {region / 2**20:.1f} MiB, parked {parked}")
        assert parked <= 1, (r, parked)
        # at most one region per rank on the GPU, plus NCCL's and the allocator's granularity
        assert kept <= sharing * (region + (4 << 20)) + (16 << 20), \
            f"rank {r}: {kept / 2**20:.1f} MiB kept after {cycles} cycles"


@needs_ranks(2)
@needs_kernels
def test_memory_kept_after_abort_is_at_most_the_exported_regions():
    """Makes visible what abort() keeps today: each aborted communicator's exported region
    (about 34 MiB per rank at the default buffer), for the peers that may still map it; at
    most that, and nothing for the destroyed ones.  Device memory is the GPU's: where ranks
    share it, every rank's regions count."""
    res = run_ranks(fa.aborted_communicators_memory, 2, timeout=300)
    sharing = 2 if gpu_count() < 2 else 1
    for r, (before, after, region, aborted) in res.items():
        kept = before - after
        print(f"\nrank {r}: {aborted} aborted communicators kept {kept / 2**20:.1f} MiB "
              f"(region {region / 2**20:.1f} MiB)")
        # per aborted communicator and rank: its region, and up to 4 MiB of NCCL's and the
        # allocator's granularity (an H100 with two ranks on it: 144.0 MiB for 2 aborted)
        assert kept <= sharing * aborted * (region + (4 << 20)) + (8 << 20), \
            f"rank {r}: {kept / 2**20:.1f} MiB kept, more than {aborted} exported regions"
