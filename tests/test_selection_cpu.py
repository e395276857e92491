"""Which all_reduce a communicator uses when pyccl's own kernels cannot run, on the CPU.

A GPU that none of the compiled kernel images fits (say a T4, sm_75, with a build for
sm_80 and newer) and a pair of GPUs without peer access (PCIe without P2P) must both give
NCCL's all_reduce on every rank, with the reason in `all_reduce_info` and said once, as a
warning of the "pyccl" logger.
The GPU machines here are all Hopper with NVLink, so this runs against the stand-in GPU
library (tests/fakegpu/fakegpu.c built with FAKE_PEER_MEMORY): two processes, one per rank,
whose NCCL all_gather/all_reduce go through files, and which also stands in for the driver
(libcuda.so.1) that loads the kernels.
"""

import pytest

import _fakes
import pyccl


if not pyccl._C._ar_built():
    pytest.skip("pyccl was built without nvcc: no kernels to choose", allow_module_level=True)


@pytest.fixture(scope="module")
def peer_lib(tmp_path_factory):
    return _fakes.peer_library(tmp_path_factory)


def run_two_ranks(lib, scenario, tmp_path, timeout=60, **extra_env):
    # the scenarios' log lines are read from stderr: not quiet
    return _fakes.run_rank_pair(lib, scenario, tmp_path, timeout, ("PYCCL_QUIET",), **extra_env)


@pytest.mark.parametrize("scenario", ["no_kernel_image", "no_peer_access", "shared_gpu_refused"])
def test_unusable_own_kernels_give_nccl_with_the_reason_said_once(peer_lib, scenario, tmp_path):
    results = run_two_ranks(peer_lib, scenario, tmp_path)
    for rank, (res, err) in enumerate(results):
        # NCCL's all_reduce (the stand-in's, across the two processes), three times:
        # (1+2, 2+2, 3+6) = (3, 4, 9), doubled twice
        assert res["values"] == [12.0, 16.0, 36.0], res
        # a record of the "pyccl" logger; without logging configured Python prints it alone
        said = [line for line in err.splitlines() if "uses NCCL" in line]
        assert said == [f"rank {rank} of 2 uses NCCL for all_reduce: {res['reason']}"], err


def test_the_note_is_a_warning_of_the_pyccl_logger(peer_lib, tmp_path):
    """Users filter it as they do torch's notes: logging.getLogger("pyccl")."""
    for rank, (res, err) in enumerate(run_two_ranks(peer_lib, "note_through_logging", tmp_path)):
        assert res["records"] == [["pyccl", "WARNING", f"rank {rank} of 2 uses NCCL for all_reduce: "
                                                       f"{res['reason']}"]], res
        assert "uses NCCL" not in err, err  # a handler took it: nothing on stderr besides


def test_pyccl_quiet_still_silences_the_note(peer_lib, tmp_path):
    for res, err in run_two_ranks(peer_lib, "note_through_logging", tmp_path, PYCCL_QUIET="1"):
        assert res["records"] == [] and "uses NCCL" not in err, (res, err)


@pytest.mark.parametrize("value", ["", "0"])
def test_pyccl_quiet_blank_or_0_is_unset(peer_lib, tmp_path, value):
    for rank, (res, _) in enumerate(run_two_ranks(peer_lib, "note_through_logging", tmp_path, PYCCL_QUIET=value)):
        assert res["records"] == [["pyccl", "WARNING", f"rank {rank} of 2 uses NCCL for all_reduce: "
                                                       f"{res['reason']}"]], res


def test_ranks_sharing_a_gpu_use_the_own_kernels_with_the_setting(peer_lib, tmp_path):
    # without it: shared_gpu_refused above; with it, no peer access is asked for the same device
    results = run_two_ranks(peer_lib, "shared_gpu_ready", tmp_path, PYCCL_AR_SHARED_GPU="1",
                            PYCCL_AR_BUFFER_MB="1")
    for res, _ in results:
        assert res["values"] == [3.0, 4.0, 9.0] and res["ipc_live"] == 0, res


def test_the_launch_floor_launches_the_empty_kernel_and_names_bad_arguments(peer_lib, tmp_path):
    # pyccl.bench --algos prints it beside the own kernels' host time: the driver's launch of an
    # empty kernel with their parameter block, the same way, `calls` times
    for res, _ in run_two_ranks(peer_lib, "launch_floor", tmp_path):
        assert type(res["us"]) is float and res["us"] > 0 and res["launches"] == 300, res
        assert res["errors"] == [
            "ValueError: _ar_launch_floor: calls must be at least 1, got 0",
            "TypeError: _ar_launch_floor: stream must be an int (a cudaStream_t), got str",
            "TypeError: _ar_launch_floor: calls must be an int, got str",
            "ValueError: _ar_launch_floor: device must be 0 to 1 (the GPUs there are), got -1",
            "RuntimeError: _ar_launch_floor: cuda:%d cannot launch with programmatic dependent "
            "launch" % res["rank"],
            "TypeError: _ar_launch_floor() takes exactly 4 arguments (3 given)"], res
        assert res["after"], res


# The stand-in also shares "device memory" between the rank processes (files mapped shared:
# CUDA IPC) and runs the probe and an int32/float32 all-reduce for the kernels, so the own
# kernels' set-up and release run whole on the CPU.

def test_ten_communicators_give_back_their_peer_memory_on_destroy(peer_lib, tmp_path):
    results = run_two_ranks(peer_lib, "own_kernels_lifecycle", tmp_path, timeout=120,
                            PYCCL_AR_BUFFER_MB="1")
    for res, _ in results:
        # [i, device bytes still held, peer mappings open, host words] after each destroy():
        # with and without a timeout (the region used to be kept whenever there was one)
        assert res["after_destroy"] == [[i, 0, 0, 0] for i in range(10)], res


def test_abort_gives_back_every_byte_once_the_peers_closed_their_mappings(peer_lib, tmp_path):
    # the release handshake (csrc/ar_region.c): a region a peer may still map is parked, and
    # freed once every peer marked it closed or exited
    results = run_two_ranks(peer_lib, "own_kernels_abort", tmp_path, PYCCL_AR_BUFFER_MB="1")
    for rank, (res, _) in enumerate(results):
        region = res["region"]
        assert res["ipc_live"] == 0 and res["host_live"] == 0 and region >= 2 << 20, res
        assert res["after"] == f"all_reduce: the communicator (rank {rank} of 2) has been aborted", res
        # the aborted communicator's region came back by the next set-up: only the new one is there
        assert res["after_next_setup"] == region, res
    r0, r1 = results[0][0], results[1][0]
    # rank 0 aborted while rank 1 still mapped its region: kept, parked
    assert r0["parked_while_peer_maps"] == [1, r0["region"]], r0
    # rank 1 released (closed its mapping, then marked): rank 0's next release freed it
    assert r0["parked_after_peer_released"] == [0, 0], r0
    # rank 1, still using its communicator, keeps only its live region
    assert r1["parked_before_release"] == [0, r1["region"]], r1
    # rank 1's own region: rank 0 had closed its mapping first, so it went at rank 1's abort
    assert r1["parked_after_release"] == [0, 0], r1
    # rank 1's process exited without releasing: rank 0's abort freed its region at once
    assert r0["parked_after_peer_exited"] == [0, 0], r0


def test_one_set_up_when_two_threads_make_the_first_call(peer_lib, tmp_path):
    results = run_two_ranks(peer_lib, "own_kernels_setup_two_threads", tmp_path,
                            PYCCL_AR_BUFFER_MB="1")
    for res, _ in results:
        assert res["values"] == [[3.0, 4.0, 9.0]] * 2, res
        assert res["ipc_live"] == 0, res
        assert res["launches"] == 4, res  # one set-up (two probe stages), two kernels


def test_coalesced_packs_with_the_copy_kernel_and_falls_back_to_torch(peer_lib, tmp_path):
    results = run_two_ranks(peer_lib, "coalesced_packs", tmp_path, PYCCL_AR_BUFFER_MB="1")
    for res, _ in results:
        assert res["wrong"] == [] and res["state"] == "ready", res
        assert res["copy_launches"] == 4, res  # 170 tensors: 160 + 10, in and out
        assert res["fallback"] == "stub torch runs no kernels (flatten_dense_tensors of 170 tensors)", res
    for rank, (res, _) in enumerate(results):
        # loaded into the communicator's device though the thread had the other one current;
        # a device whose load failed is not tried again on the next call
        assert res["module_device"] == rank and res["failed_loads"] == 1, res


def test_a_call_above_the_buffer_runs_in_chunks_of_it(peer_lib, tmp_path):
    # 3 MiB + 20 B with a 1 MiB buffer: four kernels, none staging more than the buffer (the
    # stand-in refuses and counts those), every element summed at its place
    for res, _ in run_two_ranks(peer_lib, "own_chunked", tmp_path, timeout=120,
                                PYCCL_AR_BUFFER_MB="1"):
        for name in ("oneshot", "twoshot", "twoshot out", "auto, oneshot_max 4 MiB"):
            assert res[name] == [4, 0, []], (name, res)
        assert res["twoshot out input kept"] is True, res
        assert res["auto"] == [0, 0, []], res  # auto: NCCL above the 1 MiB thresholds
        assert res["oneshot_max"] == 4 << 20, res


def test_all_gather_and_reduce_scatter_on_the_own_kernels_with_algo_oneshot(peer_lib, tmp_path):
    # [kernels, refused launches, wrong elements]: one kernel a call within the buffer, two for
    # parts larger than a launch stages (1 MiB buffer: all_gather 1 MiB + 20 B a part,
    # reduce_scatter 512 KiB + 12 B a part, two of them staged); the 4-byte unit where a part
    # is no 16-byte multiple; auto is NCCL's (no kernel)
    for res, _ in run_two_ranks(peer_lib, "own_gather_scatter", tmp_path, timeout=120,
                                PYCCL_AR_BUFFER_MB="1"):
        for name in ("ag 1024", "ag 1001", "rs 1024", "rs 1001"):
            assert res[name] == [1, 0, []], (name, res)
        assert res["ag chunked"] == [2, 0, []] and res["rs chunked"] == [2, 0, []], res
        assert res["ag auto"] == [0, 0, []] and res["rs auto"][:2] == [0, 0], res
        assert res["errors"] == [
            "ValueError: all_gather: algo must be 'auto', 'nccl' or 'oneshot', got 'twoshot'", True,
            "TypeError: all_gather: algo must be a str ('auto', 'nccl' or 'oneshot'), got int", True,
            "ValueError: all_gather: algo='oneshot' needs one output tensor, not a list", True,
            "ValueError: reduce_scatter: algo must be 'auto', 'nccl' or 'oneshot', got 'twoshot'", True,
            "ValueError: reduce_scatter: algo='oneshot' needs one input tensor, not a list", True,
            "ValueError: reduce_scatter: algo='oneshot' supports SUM, MAX and MIN, not premul_sum", True,
            "RuntimeError: all_gather: algo='oneshot' cannot run inside pyccl.group()"], res
