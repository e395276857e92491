"""GPU tier of the per-rank API (pyccl.Communicator) and its launchers.

Each test spawns one process per GPU (bounded in time: _ranks.run_ranks) and
each rank checks its own results bitwise; see _scenarios.py.
"""
import contextlib
import glob
import os
import shutil
import sys

import pytest
import torch

from conftest import gpu_count, needs_gpus, needs_ranks
from _ranks import reserved_port, run_bounded, run_ranks
import _scenarios as sc

W = max(2, min(gpu_count(), 8))  # ranks share GPUs where they outnumber them
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@needs_ranks(2)
def test_every_method_dtype_op_size():
    res = run_ranks(sc.every_method, W, timeout=420)
    assert all(n > 1000 for n in res.values()), res


@needs_ranks(2)
def test_p2p_all_to_all_gather_scatter_premul_split():
    res = run_ranks(sc.p2p_and_friends, W)
    assert set(res.values()) == {"ok"}


@needs_ranks(2)
def test_more_dtypes_every_data_movement_and_split_key():
    res = run_ranks(sc.more_dtypes_and_split_key, W)
    assert all(n >= 9 for n in res.values()), res


@needs_ranks(2)
def test_nccl_path_under_graph_capture():
    res = run_ranks(sc.nccl_graph_capture, W)
    assert all(n == 3 for n in res.values()), res


@needs_ranks(2)
def test_cupy_arrays():
    pytest.importorskip("cupy")
    res = run_ranks(sc.cupy_arrays, W)
    assert set(res.values()) == {"ok"}


@needs_ranks(2)
def test_destroyed_and_bad_op():
    res = run_ranks(sc.destroyed_and_errors, W)
    assert set(res.values()) == {"ok"}


@contextlib.contextmanager
def _env_job(extra):
    """The job's environment, its MASTER_PORT held for us until the block ends."""
    with reserved_port() as port:
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(W)}
        env.update(extra)
        yield env


@needs_ranks(2)
def test_init_from_env_tcpstore_loopback():
    # RANK/LOCAL_RANK differ per child: set inside via a small wrapper
    with _env_job({}) as env:
        res = run_ranks(_from_env_child, W, env, make_comm=False)
    assert len(res) == W


def _from_env_child(rank, world, env):
    os.environ.update(env)
    os.environ["RANK"] = os.environ["LOCAL_RANK"] = str(rank)
    return sc.from_env(rank, world)


@needs_ranks(2)
def test_emulated_two_nodes_over_the_network_transport(tmp_path):
    """Two 'nodes' (NODE_RANK 0/1) whose traffic must go through NCCL's net transport."""
    log = tmp_path / "nccl.%p.log"
    with _env_job({"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_DEBUG": "INFO",
                   "NCCL_DEBUG_SUBSYS": "INIT,NET", "NCCL_DEBUG_FILE": str(log),
                   "NCCL_SOCKET_IFNAME": "lo"}) as env:
        res = run_ranks(_node_child, W, env, make_comm=False)
    assert sorted(res.values()) == [str(r) for r in range(W)]
    text = "".join(open(f).read() for f in glob.glob(str(tmp_path / "nccl.*.log")))
    assert "NET/Socket" in text or "NET/IB" in text, text[-2000:]


def _node_child(rank, world, env):
    os.environ.update(env)
    os.environ["RANK"] = os.environ["NODE_RANK"] = str(rank)
    os.environ["LOCAL_RANK"] = str(rank)
    return sc.from_env(rank, world)


@needs_gpus(2, "one process drives several GPUs (init_ranks)")
def test_several_gpus_per_process():
    """One process holding every GPU as a rank of one job, driven in a group."""
    import pyccl

    comms = pyccl.init_ranks(W, pyccl.unique_id(), range(W), range(W))
    assert [(c.rank, c.size, c.device) for c in comms] == [(r, W, r) for r in range(W)]
    ts = [torch.full((1001,), float(r + 3), device=f"cuda:{r}") for r in range(W)]
    with pyccl.group():
        for c, t in zip(comms, ts):
            c.all_reduce(t)
    for r in range(W):
        torch.cuda.synchronize(r)
    want = float(sum(r + 3 for r in range(W)))
    assert all(torch.equal(t.cpu(), torch.full((1001,), want)) for t in ts)
    # splitting ranks of one thread must happen inside a group; rank and size
    # are known once the group ended
    with pyccl.group():
        subs = [c.split(0) for c in comms]
        with pytest.raises(RuntimeError, match=r"^rank: the communicator is not ready: "
                           r"it was created inside pyccl.group\(\), which has not ended yet$"):
            subs[0].rank
        with pytest.raises(RuntimeError, match=r"^destroy: the communicator is not ready"):
            subs[0].destroy()
    assert [(s.rank, s.size) for s in subs] == [(r, W) for r in range(W)]
    for c in subs + comms:
        c.destroy()


@needs_ranks(2)
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun is not installed")
def test_init_from_mpi():
    pytest.importorskip("mpi4py")
    # PYCCL_SHARE_GPUS: init_from_mpi puts ranks beyond the GPU count on shared GPUs
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]),
               PYCCL_SHARE_GPUS="1")
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(W),
           "-x", "PYTHONPATH", "-x", "NCCL_NVLS_ENABLE", "-x", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
           "-x", "NVSHMEM_DISABLE_NVLS", "-x", "PYCCL_SHARE_GPUS",
           sys.executable, os.path.join(ROOT, "tests", "child_mpi.py")]
    out = run_bounded(cmd, 180, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert sorted(line for line in out.stdout.splitlines() if line.startswith("mpi rank")) == \
        [f"mpi rank {r} ok" for r in range(W)]


EXAMPLES = sorted(glob.glob(os.path.join(ROOT, "examples", "*.py")))


@needs_ranks(2)
@pytest.mark.parametrize("path", EXAMPLES, ids=os.path.basename)
def test_example_runs(path):
    # W ranks as a user asks for them: RANKS for the mp.spawn examples, PYCCL_SHARE_GPUS for
    # torchrun (both only matter where ranks outnumber GPUs)
    env = dict(os.environ, PYTHONPATH=ROOT, RANKS=str(W), PYCCL_SHARE_GPUS="1")
    for k in ("NCCL_HOSTID", "NCCL_SOCKET_IFNAME", "PYCCL_AR_SHARED_GPU"):
        env.pop(k, None)  # set by pyccl in each rank, not inherited from this process
    if os.path.basename(path).startswith("torchrun"):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={W}", path]
    else:
        cmd = [sys.executable, path]
        if "benchmark" in path:
            cmd += ["--quick"]
    out = run_bounded(cmd, 300, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "OK" in out.stdout, out.stdout[-3000:]


@needs_ranks(2)
def test_abort_from_another_thread_ends_an_untimed_wait(tmp_path):
    res = run_ranks(sc.abort_untimed_from_thread, 2, str(tmp_path / "flag"), timeout=180)
    dt, err, destroyed = res[0]
    assert 0.9 <= dt < 20 and destroyed, (dt, err, destroyed)
    # the work did not finish: the wait says so, as on a communicator with a timeout
    assert err == "RuntimeError: wait: the communicator (rank 0 of 2) has been aborted", err


@needs_ranks(2)
def test_group_mixing_timed_and_untimed_is_refused():
    import pyccl
    res = run_ranks(sc.mixed_group_refused, W, pyccl.unique_id(), timeout=120)
    for r, (err, closed) in res.items():
        assert err is not None and err[0] == "NcclError" and closed, (r, err, closed)
        # refused by pyccl on every rank, at the call of the second kind (NCCL refuses only
        # where a connection or launch job is queued: not on every rank or transport)
        assert err[3] == "untimed all_reduce" and "cannot mix communicators" in err[2], (r, err)
