"""Run a function in one spawned process per rank, bounded in time and honest about exits.

The parent makes the unique id; each child starts its own session (so it and
anything it starts can be killed as one process group), sets its GPU, builds a
Communicator and runs the scenario, which checks its own results and returns
something picklable.  The parent fails the test as soon as one rank reports an
error or dies without reporting (naming the rank and its exit code or signal),
when any rank exits non-zero after reporting (a crash at interpreter exit), and
at the deadline; in every case it kills every rank's process group first.

run_bounded() is the same promise for a command line that starts workers of
its own (torchrun, mpirun, pyccl.bench, compute-sanitizer): a new session, and
the whole group killed at the deadline, not just the direct child.
"""
import contextlib
import multiprocessing as mp
import os
import queue
import signal
import socket
import subprocess
import time
import traceback

import torch


def _child(fn_name, module, rank, world, uid, q, env, extra):
    try:
        os.setsid()  # its own process group: the parent kills it and its helpers with killpg
    except OSError:
        pass
    try:
        os.environ.update(env)
        # W processes each with a thread per core oversubscribe the CPU many times
        # over and make the float64 references crawl at 4+ ranks.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, world)))
        import importlib

        import pyccl

        if torch.cuda.is_available():
            torch.cuda.set_device(rank % torch.cuda.device_count())
        fn = getattr(importlib.import_module(module), fn_name)
        if uid is None:
            out = fn(rank, world, *extra)
        else:
            comm = pyccl.Communicator(world, uid, rank)
            out = fn(comm, *extra)
        q.put((rank, "ok", out))
    except BaseException:
        q.put((rank, "error", traceback.format_exc()))


def describe_exit(code):
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


def _kill_group(pid):
    """SIGKILL the process group `pid` leads, or the process alone if it has none yet."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_ranks(fn, world, *extra, timeout=240, env=None, make_comm=True, exit_grace=60):
    """Results of fn(comm, *extra) (or fn(rank, world, *extra)) per rank."""
    import pyccl

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    uid = pyccl.unique_id() if make_comm else None
    procs = [ctx.Process(target=_child, args=(fn.__name__, fn.__module__, r, world, uid, q, env or {}, extra))
             for r in range(world)]
    for p in procs:
        p.start()
    results, errors = {}, []
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world and not errors:
            try:
                rank, status, out = q.get(timeout=0.2)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in results and p.exitcode is not None]
                if dead:
                    # what a rank put before dying is in the pipe already: read it first
                    time.sleep(0.5)
                    try:
                        while True:
                            rank, status, out = q.get(timeout=0.5)
                            if status == "ok":
                                results[rank] = out
                            else:
                                errors.append(f"rank {rank}:\n{out}")
                    except queue.Empty:
                        pass
                    for r in dead:
                        if r not in results and not errors:
                            errors.append(f"rank {r} died without reporting: {describe_exit(procs[r].exitcode)}")
                elif time.monotonic() > deadline:
                    missing = [r for r in range(world) if r not in results]
                    errors.append(f"timed out after {timeout}s waiting for ranks {missing}")
                continue
            if status == "ok":
                results[rank] = out
            else:
                errors.append(f"rank {rank}:\n{out}")  # peers of a failed rank may wait forever: stop now
        if not errors:
            # every rank reported: each must also exit cleanly (a crash in teardown counts)
            end = time.monotonic() + exit_grace
            for r, p in enumerate(procs):
                p.join(timeout=max(0.1, end - time.monotonic()))
                if p.exitcode is None:
                    errors.append(f"rank {r} reported but did not exit within {exit_grace}s")
                elif p.exitcode != 0:
                    errors.append(f"rank {r} reported but then ended with {describe_exit(p.exitcode)}")
    finally:
        for p in procs:
            if p.exitcode is None and p.pid is not None:
                _kill_group(p.pid)
        for p in procs:
            p.join(timeout=10)
    assert not errors, "\n".join(errors)
    return results


def run_bounded(cmd, timeout, **kw):
    """subprocess.run(cmd, capture_output=True, text=True, **kw) whose timeout kills
    the command's whole process group and fails the test with what it printed."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True, **kw)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(p.pid)
        out, err = p.communicate()
        raise AssertionError(f"{cmd[:4]}... timed out after {timeout}s; its process group was killed\n"
                             f"stdout:\n{(out or '')[-3000:]}\nstderr:\n{(err or '')[-3000:]}") from None
    except BaseException:
        _kill_group(p.pid)
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
def reserved_port(addr="127.0.0.1"):
    """A port that stays ours while the block runs.

    A socket bound with SO_REUSEADDR and never listening keeps the kernel from
    handing the port to anyone else, yet lets the rendezvous master (which also
    sets SO_REUSEADDR: pyccl.launch._listen_fd) bind and listen on it.  Closing
    a probe socket and hoping nobody takes the port meanwhile is the race this
    replaces.
    """
    s = socket.socket()
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((addr, 0))
        yield s.getsockname()[1]
    finally:
        s.close()
