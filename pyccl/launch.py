"""Bootstrap helpers: get every rank the same NCCL unique id, then a Communicator.

- init_from_env(): torchrun / Slurm-style variables, the id exchanged through
  torch.distributed.TCPStore (rank 0 hosts it at MASTER_ADDR:MASTER_PORT,
  listening on that address only, or torchrun's agent does).
- init_from_mpi(): mpi4py broadcasts the id.
- The mp.spawn pattern needs neither: the parent calls pyccl.unique_id() and
  passes it to its children (see examples/01_all_reduce.py).
- place_rank(): a rank's GPU on this host, and the NCCL host identity that lets
  several ranks share one GPU (development and CI on a machine with fewer GPUs
  than ranks); PYCCL_SHARE_GPUS=1 does it for init_from_env/init_from_mpi and,
  at import, for processes whose launcher names their local rank.
"""
from __future__ import annotations

import datetime
import errno
import itertools
import os
import re
import socket
import warnings
from typing import TYPE_CHECKING, Any

import torch

from . import _C
from ._gpu import need_gpu

if TYPE_CHECKING:
    from collections.abc import Iterable

_generation = itertools.count()


def _whole(value: str | None) -> int | None:
    """A launcher's number: digits, maybe signed, maybe with spaces around; None otherwise
    (int() would also take '1_0')."""
    v = (value or "").strip()
    return int(v) if re.fullmatch(r"[+-]?[0-9]+", v) else None


def _env_int(name: str, default: int | None = None) -> int:
    value = os.environ.get(name)
    if not value:  # blank is unset
        if default is None:
            raise RuntimeError(f"init_from_env: environment variable {name} is not set "
                               "(launch with torchrun, or set RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)")
        return default
    x = _whole(value)
    if x is None:
        raise ValueError(f"init_from_env: {name}={value!r} is not an integer")
    return x


# The launchers' names for a process's rank and rank count on its host: torchrun, Open MPI,
# MPICH/Hydra, MVAPICH, Slurm.
_LOCAL_VARS = (("LOCAL_RANK", "LOCAL_WORLD_SIZE"),
               ("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
               ("MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
               ("MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_SIZE"),
               ("SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"))


def _sharing_asked() -> bool:
    return os.environ.get("PYCCL_SHARE_GPUS", "") not in ("", "0")


def _share_identity(local_rank: int, gpus: int) -> None:
    """Give this process the NCCL host identity of its 'layer' of ranks: ranks local_rank //
    gpus.  Ranks of one layer sit on distinct GPUs and keep NCCL's fast paths between them;
    ranks of different layers, which may share a GPU, look to NCCL like separate hosts (it
    refuses two ranks of one host on one GPU) and talk over its network transport.  Values
    the user set stay.  Read by NCCL when a communicator is made, so this must come first."""
    given = {"NCCL_HOSTID": f"{socket.gethostname()}:pyccl-layer-{local_rank // gpus}",
             # the ranks of one host find each other on the loopback interface
             "NCCL_SOCKET_IFNAME": "lo",
             # pyccl's own kernels accept ranks on one GPU too (see ar_setup.c)
             "PYCCL_AR_SHARED_GPU": "1"}
    for name, value in given.items():
        if not os.environ.get(name):  # blank is unset
            os.environ[name] = value


def place_rank(local_rank: int, local_world: int) -> int:
    """This process's GPU as rank `local_rank` of `local_world` ranks on this host: GPU
    local_rank % (GPUs), made the current device.  Returns its index.

    Where ranks outnumber the GPUs, several share one: NCCL accepts that only when each
    looks like a host of its own, so this sets NCCL_HOSTID for the process (and
    NCCL_SOCKET_IFNAME=lo, PYCCL_AR_SHARED_GPU=1, each unless already set to a value).  It is correct
    but slow (the ranks talk over sockets and the GPU time-slices them): for developing and
    testing multi-rank code on a machine with one GPU, not for speed.  Call it before this
    process makes its first NCCL communicator (pyccl's or torch's), e.g. first thing in an
    mp.spawn worker.  A job that spans hosts sets NCCL_SOCKET_IFNAME itself.
    """
    for name, v in (("local_rank", local_rank), ("local_world", local_world)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"place_rank: {name} must be an int, got {type(v).__name__}")
    if not 0 <= local_rank < local_world:
        raise ValueError(f"place_rank: local_rank={local_rank} is out of range for "
                         f"local_world={local_world}")
    n = need_gpu("place_rank")
    if local_world > n:
        _share_identity(local_rank, n)
    torch.cuda.set_device(local_rank % n)
    return local_rank % n


def _launcher_local_rank() -> tuple[int, int] | None:
    """(local rank, local rank count) as the first launcher that set both as numbers (a rank
    from 0 below the count) gives them, or None."""
    for rank_var, size_var in _LOCAL_VARS:
        r, s = _whole(os.environ.get(rank_var)), _whole(os.environ.get(size_var))
        if r is not None and s is not None and 0 <= r < s:
            return r, s
    return None


def _share_at_import() -> None:
    """PYCCL_SHARE_GPUS=1, at `import pyccl`: where the launcher named this process's local
    rank and there are more local ranks than GPUs, its NCCL identity now, before any
    communicator (torch's "nccl" backend included) is made.  The device is left to the
    program (importing does not initialise CUDA's context)."""
    if not _sharing_asked():
        return
    local = _launcher_local_rank()
    if local is None:
        return
    n = torch.cuda.device_count()
    if n and local[1] > n:
        _share_identity(local[0], n)


def _pick_device(op: str, local_rank: int, local_world: int, device: int | str | torch.device | None) -> int:
    n = need_gpu(op)
    index = _C._read_device(op, "device", device)  # the Communicator's reading; None: pick
    if index is None:
        if _sharing_asked() and local_world > n:
            return place_rank(local_rank, local_world)
        index = local_rank % n
    torch.cuda.set_device(index)
    return index


def _listen_fd(addr: str, port: int) -> int | None:
    """A socket listening on MASTER_ADDR:MASTER_PORT only, as a file descriptor
    for TCPStore's master_listen_fd (the store then owns it).  torch's own
    store listens on every interface; None (with a warning) when this host
    cannot bind MASTER_ADDR, e.g. an address behind NAT: then it does that."""
    last: OSError | None = None
    for family, kind, proto, _, sockaddr in socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM):
        s = socket.socket(family, kind, proto)
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(sockaddr)
            s.listen(socket.SOMAXCONN)
            return s.detach()
        except OSError as e:
            s.close()
            last = e
    if getattr(last, "errno", None) == errno.EADDRINUSE:
        raise RuntimeError(f"init_from_env: MASTER_PORT={port} is in use on {addr} ({last})")
    warnings.warn(f"init_from_env: cannot listen on MASTER_ADDR={addr} ({last}); the rendezvous "
                  f"store listens on port {port} of every interface instead", RuntimeWarning, stacklevel=3)
    return None


def init_from_env(
    timeout: float | datetime.timedelta | None = 300.0,
    device: int | str | torch.device | None = None,
) -> _C.Communicator:
    """This process's Communicator of a torchrun-style job.

    Reads RANK, WORLD_SIZE, LOCAL_RANK (default: RANK), LOCAL_WORLD_SIZE (default:
    WORLD_SIZE), MASTER_ADDR and MASTER_PORT.  The device is LOCAL_RANK modulo the GPU
    count; with PYCCL_SHARE_GPUS=1, ranks outnumbering GPUs share them (see place_rank).
    `timeout` (seconds, or a datetime.timedelta) bounds the wait for the unique id in the
    store and is the communicator's timeout (see Communicator): its init and
    every collective must finish within it, else pyccl.NcclTimeoutError.
    timeout=None: NCCL's blocking mode, unwatched (the store waits 300 s).
    `device`: an int, "cuda:N" or a torch.device (default: LOCAL_RANK modulo the GPU count).
    """
    seconds = _C._read_timeout("init_from_env", timeout)
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if not os.environ.get(k)]
    if missing:
        raise RuntimeError(f"init_from_env: environment variables {', '.join(missing)} are not set "
                           "(launch with torchrun, or set them yourself)")
    rank = _env_int("RANK")
    world = _env_int("WORLD_SIZE")
    local_rank = _env_int("LOCAL_RANK", rank)
    local_world = _env_int("LOCAL_WORLD_SIZE", world)
    addr = os.environ["MASTER_ADDR"]
    port = _env_int("MASTER_PORT")
    if not 0 <= rank < world:
        raise ValueError(f"init_from_env: RANK={rank} is out of range for WORLD_SIZE={world}")
    if os.environ.get("LOCAL_RANK") and not 0 <= local_rank < local_world:  # (its default: RANK)
        raise ValueError(f"init_from_env: LOCAL_RANK={local_rank} is out of range for "
                         f"LOCAL_WORLD_SIZE={local_world}")
    if not 1 <= port <= 65535:
        raise ValueError(f"init_from_env: MASTER_PORT={port} is not a port (1 to 65535)")
    index = _pick_device("init_from_env", local_rank, local_world, device)
    from torch.distributed import TCPStore

    # Under torchrun the agent already serves a store on MASTER_PORT.
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    is_master = rank == 0 and not agent_store
    # The store is unauthenticated: serve it on MASTER_ADDR only.
    fd = _listen_fd(addr, port) if is_master else None
    try:
        store = TCPStore(addr, port, world, is_master=is_master,
                         timeout=datetime.timedelta(seconds=seconds or 300.0), wait_for_workers=False,
                         **({} if fd is None else {"master_listen_fd": fd}))
    except BaseException:
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass  # the store took it before failing
        raise
    key = f"pyccl/unique_id/{next(_generation)}"
    if rank == 0:
        uid = _C._nccl_unique_id()
        store.set(key, uid)
    else:
        uid = store.get(key)
    # Every rank has read the id once NCCL's init returns (it needs all of
    # them), so the store can go with this frame.
    return _C.Communicator(world, uid, rank, index, seconds)


def init_from_mpi(
    comm: Any = None,
    device: int | str | torch.device | None = None,
    timeout: float | datetime.timedelta | None = None,
) -> _C.Communicator:
    """This process's Communicator, bootstrapped through mpi4py (MPI.COMM_WORLD by default).

    `timeout`: the communicator's (see Communicator); None: NCCL's blocking mode.
    `device`: an int, "cuda:N" or a torch.device (default: the node-local rank modulo the GPU count).
    """
    seconds = _C._read_timeout("init_from_mpi", timeout)
    try:
        from mpi4py import MPI  # type: ignore[import-not-found,unused-ignore]
    except ImportError as e:
        raise RuntimeError("init_from_mpi: mpi4py is not installed") from e
    comm = MPI.COMM_WORLD if comm is None else comm
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    local_rank, local_world = local.Get_rank(), local.Get_size()
    local.Free()
    index = _pick_device("init_from_mpi", local_rank, local_world, device)
    uid = _C._nccl_unique_id() if comm.Get_rank() == 0 else None
    uid = comm.bcast(uid, root=0)
    return _C.Communicator(comm.Get_size(), uid, comm.Get_rank(), index, seconds)


def init_ranks(
    world_size: int,
    unique_id: bytes,
    ranks: Iterable[int],
    devices: Iterable[int | str | torch.device],
) -> list[_C.Communicator]:
    """Several ranks in this process (one per device in `devices`), created together.

    Drive them together inside `with pyccl.group():`.
    """
    return _C._nccl_init_ranks(world_size, unique_id, list(ranks), list(devices))
