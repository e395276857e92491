"""Ranks sharing GPUs (pyccl.place_rank, PYCCL_SHARE_GPUS): which GPU a rank gets and the NCCL
host identity each rank process is given, on the CPU (torch's GPU count and set_device stood in)."""
import os
import subprocess
import sys

import pytest
import torch

import pyccl
from pyccl import launch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SET_BY_SHARING = ("NCCL_HOSTID", "NCCL_SOCKET_IFNAME", "PYCCL_AR_SHARED_GPU")


@pytest.fixture
def gpus(monkeypatch):
    """A machine with `gpus.n` GPUs; gpus.current is what set_device was told."""
    class G:
        n = 1
        current = None
    def need_gpu(op):  # pyccl._gpu.need_gpu's answer on a machine with G.n GPUs
        if G.n == 0:
            raise pyccl.CudaError(f"{op}: no CUDA GPU is available")
        return G.n
    monkeypatch.setattr(torch.cuda, "device_count", lambda: G.n)
    monkeypatch.setattr(launch, "need_gpu", need_gpu)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: setattr(G, "current", d))
    for k in SET_BY_SHARING + ("PYCCL_SHARE_GPUS",):
        monkeypatch.setenv(k, "")  # recorded, so that teardown restores what place_rank sets
        monkeypatch.delenv(k)
    return G


def test_ranks_up_to_the_gpu_count_keep_nccl_as_it_is(gpus):
    gpus.n = 4
    assert [pyccl.place_rank(r, 4) for r in range(4)] == [0, 1, 2, 3]
    assert gpus.current == 3
    assert not any(k in os.environ for k in SET_BY_SHARING)


@pytest.mark.parametrize("n,world", [(1, 2), (1, 4), (2, 4), (2, 3), (3, 8)])
def test_ranks_beyond_the_gpu_count_share_round_robin_each_layer_its_own_host(gpus, monkeypatch, n, world):
    gpus.n = n
    ids = []
    for r in range(world):
        for k in SET_BY_SHARING:
            monkeypatch.delenv(k, raising=False)
        assert pyccl.place_rank(r, world) == r % n and gpus.current == r % n
        ids.append(os.environ["NCCL_HOSTID"])
        assert os.environ["NCCL_SOCKET_IFNAME"] == "lo" and os.environ["PYCCL_AR_SHARED_GPU"] == "1"
    # two ranks on one GPU never share an identity (NCCL would refuse them); ranks of one
    # layer (distinct GPUs) do, so NCCL's fast paths between them stay
    for a in range(world):
        for b in range(world):
            if a != b:
                assert (ids[a] == ids[b]) == (a // n == b // n), (a, b, ids)


def test_values_the_user_set_stay(gpus, monkeypatch):
    monkeypatch.setenv("NCCL_HOSTID", "mine")
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "eth7")
    monkeypatch.setenv("PYCCL_AR_SHARED_GPU", "0")
    assert pyccl.place_rank(1, 2) == 0
    assert [os.environ[k] for k in SET_BY_SHARING] == ["mine", "eth7", "0"]


def test_blank_values_are_unset(gpus, monkeypatch):
    # a blank NCCL_HOSTID would leave two ranks on one GPU looking like one host to NCCL
    for k in SET_BY_SHARING:
        monkeypatch.setenv(k, "")
    assert pyccl.place_rank(1, 2) == 0
    got = [os.environ[k] for k in SET_BY_SHARING]
    assert got[0].endswith(":pyccl-layer-1") and got[1:] == ["lo", "1"], got


@pytest.mark.parametrize("args,exc,msg", [
    ((2, 2), ValueError, "place_rank: local_rank=2 is out of range for local_world=2"),
    ((-1, 2), ValueError, "place_rank: local_rank=-1 is out of range for local_world=2"),
    ((0, 0), ValueError, "place_rank: local_rank=0 is out of range for local_world=0"),
    (("0", 2), TypeError, "place_rank: local_rank must be an int, got str"),
    ((0, 2.0), TypeError, "place_rank: local_world must be an int, got float"),
    ((True, 2), TypeError, "place_rank: local_rank must be an int, got bool"),
])
def test_bad_arguments(gpus, args, exc, msg):
    with pytest.raises(exc) as e:
        pyccl.place_rank(*args)
    assert str(e.value) == msg
    assert gpus.current is None and "NCCL_HOSTID" not in os.environ
    assert pyccl.place_rank(0, 1) == 0  # still usable


def test_no_gpu(gpus):
    gpus.n = 0
    with pytest.raises(pyccl.CudaError) as e:
        pyccl.place_rank(0, 2)
    assert str(e.value) == "place_rank: no CUDA GPU is available"


@pytest.mark.parametrize("share,local,n,expect", [
    ("1", {"LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "4"}, 1, "layer-3"),
    # a blank or malformed pair is passed over for the next launcher's
    ("1", {"LOCAL_RANK": "", "LOCAL_WORLD_SIZE": "", "OMPI_COMM_WORLD_LOCAL_RANK": "3",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}, 2, "layer-1"),
    ("1", {"LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "4(x2)", "SLURM_LOCALID": "2",
           "SLURM_NTASKS_PER_NODE": "4"}, 1, "layer-2"),
    ("1", {"OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}, 2, "layer-0"),
    ("1", {"OMPI_COMM_WORLD_LOCAL_RANK": "3", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}, 2, "layer-1"),
    ("1", {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}, 2, None),   # a GPU each: nothing to do
    ("1", {}, 1, None),                                            # no launcher: place_rank's job
    ("0", {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}, 1, None),  # not asked for
    ("", {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}, 1, None),
])
def test_at_import_with_pyccl_share_gpus(share, local, n, expect):
    """PYCCL_SHARE_GPUS=1 gives a launched rank process its identity at `import pyccl`, before
    any communicator (torch's "nccl" backend's too) exists; the device stays the program's."""
    code = ("import os, torch; torch.cuda.device_count = lambda: %d\n"
            "import pyccl\n"
            "print(os.environ.get('NCCL_HOSTID'), os.environ.get('NCCL_SOCKET_IFNAME'),"
            " os.environ.get('PYCCL_AR_SHARED_GPU'))" % n)
    env = {k: v for k, v in os.environ.items()
           if k not in SET_BY_SHARING and not k.startswith(("LOCAL_", "OMPI_", "MPI_", "MV2_", "SLURM_"))}
    env.update(local, PYCCL_SHARE_GPUS=share, PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    hostid, ifname, shared = out.stdout.split()
    if expect is None:
        assert (hostid, ifname, shared) == ("None", "None", "None"), out.stdout
    else:
        assert hostid.endswith(":pyccl-" + expect) and ifname == "lo" and shared == "1", out.stdout


def test_init_from_env_shares_with_the_setting(gpus, monkeypatch):
    """init_from_env picks LOCAL_RANK % GPUs; with PYCCL_SHARE_GPUS=1 and more local ranks than
    GPUs it gives the identity too (before its communicator)."""
    seen = {}
    gpus.n = 2  # local rank 3 of 4: GPU 1

    def fake_comm(world, uid, rank, device, timeout):
        seen.update(world=world, rank=rank, device=device, hostid=os.environ.get("NCCL_HOSTID"))
        raise RuntimeError("stop here")

    class Store:
        def __init__(self, *a, **k):
            pass

        def get(self, key):
            return b"x" * 128

    import torch.distributed
    monkeypatch.setattr(torch.distributed, "TCPStore", Store)
    monkeypatch.setattr(launch._C, "Communicator", fake_comm)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29999")
    with pytest.raises(RuntimeError, match="stop here"):
        pyccl.init_from_env()
    assert seen == {"world": 4, "rank": 3, "device": 1, "hostid": None}  # not asked for
    monkeypatch.setenv("PYCCL_SHARE_GPUS", "1")
    with pytest.raises(RuntimeError, match="stop here"):
        pyccl.init_from_env()
    assert seen["device"] == 1 and seen["hostid"].endswith(":pyccl-layer-1"), seen  # 3 // 2
