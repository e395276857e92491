"""Spawned processes, one per rank, for the benchmark and the tests, never waited on without bound.

start() spawns the processes, each with the write end of its own pipe: the parent sees every
message a process sent before it died, then end-of-file (so a crash is noticed at once, with
whatever it reported). kill_all() SIGKILLs a run's processes, their process groups and everything
below them, and reaps them. die_with_parent() (Linux) makes a child die with its parent, even when
the parent is SIGKILLed, so nothing is left holding a GPU. pyccl.bench's runner drives these with
its own messages and no-progress watchdog; run_ranks() is the tests' form: fn per rank, its
results back, the first failure (an error, a death, a hang past the deadline, a crash at exit)
fails the call. run_bounded() gives a command line that starts workers of its own (torchrun,
mpirun, pyccl.bench) the same promise. torch and pyccl are imported inside the functions, so
this module loads without a GPU.
"""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
import traceback
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from multiprocessing.connection import Connection
    from multiprocessing.context import SpawnContext
    from multiprocessing.process import BaseProcess


def context() -> SpawnContext:
    """The spawn context (torch's where torch is there: its pickling of tensors)."""
    try:
        import torch.multiprocessing as mp
    except ImportError:
        import multiprocessing as mp
    return mp.get_context("spawn")


def describe_exit(code: int | None) -> str:
    """'exit code 3' or 'killed by signal SIGSEGV (11)' for a Popen/Process exit status."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "signal"
        return f"killed by signal {name} ({-code})"
    return f"exit code {code}"


def start(ctx: SpawnContext, target: Callable[..., object], argsets: Sequence[tuple[Any, ...]],
          names: Sequence[str] | None = None) -> tuple[list[BaseProcess], dict[Connection, int]]:
    """Spawn target(*args, conn) for each args tuple, conn being the write end of the process's
    own pipe; -> (processes, {read end: index}). The parent's copy of each write end is closed,
    so a process's exit is end-of-file on its read end."""
    pipes = [ctx.Pipe(duplex=False) for _ in argsets]
    procs = [ctx.Process(target=target, args=(*args, w), daemon=True,
                         name=names[i] if names else None)
             for i, (args, (_, w)) in enumerate(zip(argsets, pipes))]
    try:
        for p, (_, w) in zip(procs, pipes):
            p.start()
            w.close()
    except BaseException:
        kill_all(procs)
        for r, _ in pipes:
            r.close()
        raise
    return procs, {r: i for i, (r, _) in enumerate(pipes)}


def receive(readers: dict[Connection, int], timeout: float | None) -> list[tuple[int, Any]]:
    """[(index, message)] of what arrived within timeout seconds; message None means end-of-file
    (everything that process sent has been read; its reader is dropped from readers)."""
    from multiprocessing.connection import wait
    out: list[tuple[int, Any]] = []
    for r in wait(list(readers), timeout=timeout):
        i = readers[r]
        try:
            out.append((i, r.recv()))
        except EOFError:
            del readers[r]
            r.close()
            out.append((i, None))
    return out


def close(readers: dict[Connection, int]) -> None:
    for r in list(readers):
        r.close()
    readers.clear()


def die_with_parent(parent_pid: int) -> None:
    """Linux: SIGKILL this process when the parent dies, even by SIGKILL (no orphan on a GPU)."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:  # not Linux, or no prctl: the parent's kill still covers normal cases
        return
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def descendants(pid: int) -> list[int]:
    """Pids of every process below pid (Linux /proc; empty elsewhere)."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for e in entries:
        if not e.isdigit():
            continue
        try:
            with open(f"/proc/{e}/stat", "rb") as f:
                stat = f.read()
            ppid = int(stat[stat.rindex(b")") + 2:].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(e))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), ()):
            out.append(c)
            todo.append(c)
    return out


def running(pid: int) -> bool:
    """pid exists and is not a zombie (Linux /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rindex(b")") + 2:stat.rindex(b")") + 3] not in (b"Z", b"X")


def kill_group(pid: int) -> None:
    """SIGKILL the process group `pid` leads, or the process alone if it has none yet."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def kill_all(procs: Sequence[BaseProcess], wait: float = 20.0) -> list[int]:
    """SIGKILL every live process of procs, the process groups they lead and everything below
    them, then reap them. -> the pids still alive after `wait` seconds (stuck in the kernel or
    the GPU driver: a process tearing down GPU contexts can take a few seconds)."""
    victims: list[int] = []
    live = [p for p in procs if p.pid is not None and p.is_alive()]
    for p in live:
        victims += descendants(p.pid)
    for p in live:
        try:
            leads = os.getpgid(p.pid) == p.pid
        except OSError:
            leads = False
        if leads:
            kill_group(p.pid)
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    for p in live:
        if p.is_alive():
            p.kill()
    deadline = time.monotonic() + wait
    for p in procs:
        if p.pid is not None:
            p.join(max(0.1, deadline - time.monotonic()))
    left = [p.pid for p in procs if p.pid is not None and p.is_alive()]
    for pid in victims:
        while time.monotonic() < deadline and running(pid):
            time.sleep(0.1)  # an orphan is reaped by init; wait until it is gone
        if running(pid):
            left.append(pid)
    return left


# ---- the tests' harness -----------------------------------------------------------------------

def _rank_child(fn_name: str, module: str, rank: int, world: int, uid: bytes | None, env: Mapping[str, str],
                extra: tuple[Any, ...], parent_pid: int, conn: Connection) -> None:
    try:
        os.setsid()  # its own process group: kill_all takes it and its helpers together
    except OSError:
        pass
    die_with_parent(parent_pid)
    try:
        os.environ.update(env)
        import importlib

        import torch
        # W processes each with a thread per core oversubscribe the CPU many times
        # over and make the float64 references crawl at 4+ ranks.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, world)))
        import pyccl

        if torch.cuda.is_available():
            # GPU rank % GPUs; where ranks outnumber GPUs, each process its own NCCL identity
            pyccl.place_rank(rank, world)
        fn = getattr(importlib.import_module(module), fn_name)
        if uid is None:
            out = fn(rank, world, *extra)
        else:
            comm = pyccl.Communicator(world, uid, rank)
            out = fn(comm, *extra)
        conn.send(("ok", out))
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def run_ranks(fn: Callable[..., Any], world: int, *extra: Any, timeout: float = 240,
              env: Mapping[str, str] | None = None, make_comm: bool = True, exit_grace: float = 60,
              killed: Collection[int] = ()) -> dict[int, Any]:
    """{rank: fn(comm, *extra)} (or fn(rank, world, *extra) with make_comm=False), each rank in
    a spawned process of its own session with env added to its environment. Raises
    AssertionError as soon as one rank reports an error or dies without reporting (naming the
    rank and its exit code or signal), when a rank exits non-zero or not at all within
    exit_grace seconds after reporting (a crash at interpreter exit), and at the deadline; in
    every case every rank's process group is killed first.  Ranks in `killed` are meant to
    SIGKILL themselves: for them that, and only that, is the expected end (no result)."""
    import pyccl

    uid = pyccl.unique_id() if make_comm else None
    argsets = [(fn.__name__, fn.__module__, r, world, uid, env or {}, extra, os.getpid())
               for r in range(world)]
    procs, readers = start(context(), _rank_child, argsets)
    results: dict[int, Any] = {}
    errors: list[str] = []
    deadline = time.monotonic() + timeout
    try:
        want = world - len(set(killed))
        while len(results) < want and not errors:
            for rank, msg in receive(readers, 0.2):
                if msg is None and rank in killed:
                    procs[rank].join(5.0)
                    if procs[rank].exitcode != -signal.SIGKILL:
                        errors.append(f"rank {rank} was to be killed but ended with "
                                      f"{describe_exit(procs[rank].exitcode)}")
                elif msg is None:
                    if rank not in results:
                        procs[rank].join(5.0)
                        errors.append(f"rank {rank} died without reporting: "
                                      f"{describe_exit(procs[rank].exitcode)}")
                elif msg[0] == "ok":
                    results[rank] = msg[1]
                else:  # peers of a failed rank may wait forever: stop now
                    errors.append(f"rank {rank}:\n{msg[1]}")
            if not errors and len(results) < want and time.monotonic() > deadline:
                missing = [r for r in range(world) if r not in results and r not in killed]
                errors.append(f"timed out after {timeout}s waiting for ranks {missing}")
        if not errors:
            # every rank reported: each must also exit cleanly (a crash in teardown counts)
            end = time.monotonic() + exit_grace
            for r, p in enumerate(procs):
                p.join(timeout=max(0.1, end - time.monotonic()))
                if r in killed:
                    if p.exitcode != -signal.SIGKILL:
                        errors.append(f"rank {r} was to be killed but ended with {describe_exit(p.exitcode)}")
                elif p.exitcode is None:
                    errors.append(f"rank {r} reported but did not exit within {exit_grace}s")
                elif p.exitcode != 0:
                    errors.append(f"rank {r} reported but then ended with {describe_exit(p.exitcode)}")
    finally:
        kill_all(procs, wait=10.0)
        close(readers)
    assert not errors, "\n".join(errors)
    return results


def run_bounded(cmd: Sequence[str], timeout: float, **kw: Any) -> subprocess.CompletedProcess[str]:
    """subprocess.run(cmd, capture_output=True, text=True, **kw) whose timeout kills the
    command's whole process group and raises AssertionError with what it printed."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True, **kw)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(p.pid)
        out, err = p.communicate()
        raise AssertionError(f"{cmd[:4]}... timed out after {timeout}s; its process group was killed\n"
                             f"stdout:\n{(out or '')[-3000:]}\nstderr:\n{(err or '')[-3000:]}") from None
    except BaseException:
        kill_group(p.pid)
        p.communicate()
        raise
    finally:
        # workers that outlived a finished launcher still hold GPUs: end them too
        if p.returncode is not None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


@contextlib.contextmanager
def reserved_port(addr: str = "127.0.0.1") -> Iterator[int]:
    """A port that stays ours while the block runs.

    A socket bound with SO_REUSEADDR and never listening keeps the kernel from handing the port
    to anyone else, yet lets the rendezvous master (which also sets SO_REUSEADDR:
    pyccl.launch._listen_fd) bind and listen on it. Closing a probe socket and hoping nobody
    takes the port meanwhile is the race this replaces.
    """
    s = socket.socket()
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((addr, 0))
        yield s.getsockname()[1]
    finally:
        s.close()


__all__ = ["context", "describe_exit", "start", "receive", "close", "die_with_parent",
           "descendants", "running", "kill_group", "kill_all", "run_ranks", "run_bounded",
           "reserved_port"]
