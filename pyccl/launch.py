"""Bootstrap helpers: get every rank the same NCCL unique id, then a Communicator.

- init_from_env(): torchrun / Slurm-style variables, the id exchanged through
  torch.distributed.TCPStore (rank 0 hosts it at MASTER_ADDR:MASTER_PORT,
  listening on that address only, or torchrun's agent does).
- init_from_mpi(): mpi4py broadcasts the id.
- The mp.spawn pattern needs neither: the parent calls pyccl.unique_id() and
  passes it to its children (see examples/01_all_reduce.py).
"""
import datetime
import errno
import itertools
import os
import socket
import warnings

import torch

from . import _C
from ._gpu import need_gpu

_generation = itertools.count()


def _env_int(name, default=None):
    value = os.environ.get(name)
    if value is None:
        if default is None:
            raise RuntimeError(f"init_from_env: environment variable {name} is not set "
                               "(launch with torchrun, or set RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)")
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"init_from_env: {name}={value!r} is not an integer") from None


def _pick_device(op, local_rank, device):
    n = need_gpu(op)
    device = _C._read_device(op, "device", device)  # the Communicator's reading; None: pick
    if device is None:
        device = local_rank % n
    torch.cuda.set_device(device)
    return device


def _listen_fd(addr, port):
    """A socket listening on MASTER_ADDR:MASTER_PORT only, as a file descriptor
    for TCPStore's master_listen_fd (the store then owns it).  torch's own
    store listens on every interface; None (with a warning) when this host
    cannot bind MASTER_ADDR, e.g. an address behind NAT: then it does that."""
    last = None
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


def init_from_env(timeout=300.0, device=None):
    """This process's Communicator of a torchrun-style job.

    Reads RANK, WORLD_SIZE, LOCAL_RANK (default: RANK), MASTER_ADDR and
    MASTER_PORT.  `timeout` (seconds) bounds the wait for the unique id in the
    store and is the communicator's timeout (see Communicator): its init and
    every collective must finish within it, else pyccl.NcclTimeoutError.
    timeout=None: NCCL's blocking mode, unwatched (the store waits 300 s).
    `device`: an int, "cuda:N" or a torch.device (default: LOCAL_RANK modulo the GPU count).
    """
    timeout = _C._read_timeout("init_from_env", timeout)
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(f"init_from_env: environment variables {', '.join(missing)} are not set "
                           "(launch with torchrun, or set them yourself)")
    rank = _env_int("RANK")
    world = _env_int("WORLD_SIZE")
    local_rank = _env_int("LOCAL_RANK", rank)
    addr = os.environ["MASTER_ADDR"]
    port = _env_int("MASTER_PORT")
    if not 0 <= rank < world:
        raise ValueError(f"init_from_env: RANK={rank} is out of range for WORLD_SIZE={world}")
    device = _pick_device("init_from_env", local_rank, device)
    from torch.distributed import TCPStore

    # Under torchrun the agent already serves a store on MASTER_PORT.
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    is_master = rank == 0 and not agent_store
    # The store is unauthenticated: serve it on MASTER_ADDR only.
    fd = _listen_fd(addr, port) if is_master else None
    try:
        store = TCPStore(addr, port, world, is_master=is_master,
                         timeout=datetime.timedelta(seconds=timeout or 300.0), wait_for_workers=False,
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
    return _C.Communicator(world, uid, rank, device, timeout)


def init_from_mpi(comm=None, device=None, timeout=None):
    """This process's Communicator, bootstrapped through mpi4py (MPI.COMM_WORLD by default).

    `timeout`: the communicator's (see Communicator); None: NCCL's blocking mode.
    `device`: an int, "cuda:N" or a torch.device (default: the node-local rank modulo the GPU count).
    """
    timeout = _C._read_timeout("init_from_mpi", timeout)
    try:
        from mpi4py import MPI  # type: ignore[import-not-found,unused-ignore]
    except ImportError as e:
        raise RuntimeError("init_from_mpi: mpi4py is not installed") from e
    comm = MPI.COMM_WORLD if comm is None else comm
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    local_rank = local.Get_rank()
    local.Free()
    device = _pick_device("init_from_mpi", local_rank, device)
    uid = _C._nccl_unique_id() if comm.Get_rank() == 0 else None
    uid = comm.bcast(uid, root=0)
    return _C.Communicator(comm.Get_size(), uid, comm.Get_rank(), device, timeout)


def init_ranks(world_size, unique_id, ranks, devices):
    """Several ranks in this process (one per device in `devices`), created together.

    Drive them together inside `with pyccl.group():`.
    """
    return _C._nccl_init_ranks(world_size, unique_id, list(ranks), list(devices))
