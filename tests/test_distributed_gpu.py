"""GPU tier of the torch.distributed backend "pyccl" (pyccl/distributed.py).

1 GPU: a world-size-1 group, every op through dist.* checked bitwise against what
it means at one rank, async Works on a side stream, one DDP step against a plain one.
2 ranks (on any GPU count; ranks share a GPU where there is one): every op against a "nccl" group of the same processes (the oracle, bitwise on
integer data), DDP 50 fp32 steps bitwise equal to DDP on "nccl", and a SIGKILLed peer
under DDP making the survivor raise within timeout + 2 s.
Every rank is its own process (tests/_ranks.py), bounded in time.  The multi-rank tests use
2 ranks: bitwise equality with NCCL of float sums (and of
bfloat16 integers past 256) holds for 2 ranks, whose sum has one order.
"""
import os

from conftest import needs_gpus, needs_ranks
from _ranks import run_ranks
import _dist_scenarios as ds

TIMEOUT = 5.0
SLACK = 2.0


@needs_gpus(1)
def test_one_rank_every_op_async_and_ddp_step():
    res = run_ranks(ds.one_rank_every_op, 1, make_comm=False, timeout=420)
    assert res[0] >= 291, res  # 4 sizes x (22 int32 + 25 float32 + 25 bfloat16 checks) + 3


@needs_ranks(2)
def test_every_op_against_nccl(tmp_path):
    res = run_ranks(ds.vs_nccl_every_op, 2, str(tmp_path / "store"), make_comm=False, timeout=420)
    assert all(n >= 245 for n in res.values()), res  # 4 sizes x (18 + 21..22 + 21..22) + 5


@needs_ranks(2)
def test_ddp_50_steps_bitwise_equal_to_nccl(tmp_path):
    res = run_ranks(ds.ddp_vs_nccl, 2, str(tmp_path / "store"), make_comm=False, timeout=300)
    for first, last in res.values():
        assert last < first, res  # it trained


@needs_ranks(2)
def test_ddp_killed_peer_raises_within_timeout(tmp_path):
    """The last rank SIGKILLs itself after 20 steps; every other rank must raise within TIMEOUT + SLACK."""
    world = 2
    results = run_ranks(ds.ddp_killed_peer, world, str(tmp_path / "store"), TIMEOUT, 20,
                        make_comm=False, timeout=180, killed=(world - 1,))
    for rank, (elapsed, kind, text, step) in results.items():
        assert elapsed <= TIMEOUT + SLACK, f"rank {rank} raised {elapsed:.2f} s after the kill: {kind}: {text}"
        assert "timed out" in text or "abort" in text, f"rank {rank}: {kind}: {text}"


@needs_ranks(4)
def test_survivors_shrink_the_default_group_after_one_of_4_is_killed(tmp_path):
    """The last of 4 ranks SIGKILLs itself mid-loop: the other 3 raise within TIMEOUT + SLACK,
    pyccl.distributed.shrink_group() the default "pyccl" group, and finish on 3 ranks, bitwise."""
    world = 4
    results = run_ranks(ds.survivors_shrink_group, world, str(tmp_path / "store"), TIMEOUT,
                        make_comm=False, timeout=240, killed=(world - 1,))
    assert sorted(results) == [0, 1, 2], results
    for rank, (elapsed, size, new_rank) in results.items():
        print(f"\nrank {rank} raised {elapsed:.2f} s after the kill; now rank {new_rank} of {size}")
        assert elapsed is not None and elapsed <= TIMEOUT + SLACK, (rank, elapsed)
        assert (size, new_rank) == (world - 1, rank), (rank, size, new_rank)


@needs_gpus(1)
def test_example_06_ddp_backend():
    import sys
    from _ranks import run_bounded
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = run_bounded([sys.executable, os.path.join(root, "examples", "06_ddp_backend.py")], timeout=300,
                    env=dict(os.environ, PYTHONPATH=root, STEPS="150"), cwd=root)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.splitlines()[-1].startswith("OK: DDP over "), r.stdout


@needs_gpus(1)
def test_device_id_one_rank(tmp_path):
    res = run_ranks(ds.device_id_places_groups, 1, str(tmp_path / "store"), make_comm=False, timeout=120)
    assert res[0]["world"] == 0 and res[0]["sub"] == 0, res


@needs_gpus(2, "device_id names another GPU than the current one")
def test_device_id_places_each_ranks_communicator(tmp_path):
    # every rank's current device is cuda:0; device_id=cuda:rank decides
    res = run_ranks(ds.device_id_places_groups, 2, str(tmp_path / "store"), make_comm=False, timeout=120)
    for r, got in res.items():
        assert got["world"] == r and got["sub"] == r, res
