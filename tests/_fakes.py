"""Stand-ins for the CPU tier: FakeCuda (a host tensor that says it is on a GPU) and the
stand-in GPU library tests/fakegpu/fakegpu.c (libnccl + libcudart), compiled on demand."""
import os

import torch


class FakeCuda(torch.Tensor):
    """A host tensor that reports itself as a CUDA tensor on `device`.

    pyccl reads tensors through their Python attributes (is_cuda,
    get_device(), data_ptr(), ...), so this reaches pyccl.nccl's validation
    without a GPU.  Its memory is host memory: use it only for calls that must
    fail validation, or that have nothing to move (zero elements).  Views of
    one host tensor alias, so overlaps between FakeCuda tensors are real.
    """

    @staticmethod
    def __new__(cls, data, device=0):
        t = torch.Tensor._make_subclass(cls, data)
        t._fake_device = device
        return t

    @property
    def is_cuda(self):
        return True

    def get_device(self):
        return self._fake_device


def fake(n=4, device=0, dtype=torch.float32):
    return FakeCuda(torch.arange(n).to(dtype), device)


def build_fakegpu(out_dir, peer_memory=False):
    """Compile tests/fakegpu/fakegpu.c (a stand-in libnccl + libcudart) into
    out_dir; the path of the library, or None when there is no C compiler.
    peer_memory: built with FAKE_PEER_MEMORY (ranks as processes, peer memory, the
    own kernels), and also linked as out_dir/libcuda.so.1, the driver that loads the
    kernels (found through LD_LIBRARY_PATH)."""
    import shlex
    import shutil
    import subprocess
    import sysconfig
    cc = shlex.split(sysconfig.get_config_var("CC") or "cc")
    if shutil.which(cc[0]) is None:
        return None
    out = os.path.join(str(out_dir), "libfakegpu_peer.so" if peer_memory else "libfakegpu.so")
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fakegpu", "fakegpu.c")
    r = subprocess.run(cc + ["-shared", "-fPIC", "-O1", "-Wall", "-Wextra", "-Werror"]
                       + (["-DFAKE_PEER_MEMORY"] if peer_memory else []) + ["-o", out, src,
                       "-lpthread", "-lm"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    if peer_memory:
        os.symlink(out, os.path.join(str(out_dir), "libcuda.so.1"))
    return out


def run_stand_in(out_dir, scenario, stdin=None):
    """tests/child_fakegpu.py's `scenario` run on the stand-in GPU library (built into
    out_dir) in a process of its own; its RESULT.  Skips where there is no C compiler."""
    import json
    import subprocess
    import sys

    import pytest
    lib = build_fakegpu(out_dir)
    if lib is None:
        pytest.skip("no C compiler to build the stand-in GPU library")
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    r = subprocess.run([sys.executable, os.path.join(here, "child_fakegpu.py"), lib, scenario],
                       input=stdin, capture_output=True, text=True, timeout=120, env=env)
    results = [json.loads(line[7:]) for line in r.stdout.splitlines() if line.startswith("RESULT ")]
    assert r.returncode == 0 and results, f"rc {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return results[0]


def peer_library(tmp_path_factory, name="fakepeer"):
    """The FAKE_PEER_MEMORY stand-in (a module fixture's body); skips without a C compiler."""
    import pytest
    lib = build_fakegpu(tmp_path_factory.mktemp(name), peer_memory=True)
    if lib is None:
        pytest.skip("no C compiler to build the stand-in GPU library")
    return lib


def run_rank_pair(lib, scenario, tmp_path, limit=60, drop=(), **extra_env):
    """tests/child_fakegpu.py's `scenario` as ranks 0 and 1 (FAKE_RANK), each a process of its
    own on the FAKE_PEER_MEMORY library `lib`, sharing tmp_path: [(RESULT, stderr)] per rank.
    A rank that fails, or does not end within `limit` s (or reports a hang through
    faulthandler's dump), fails the test with its output.  `drop`: environment variables
    taken away; extra_env: set."""
    import json
    import subprocess
    import sys
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, FAKE_XPROC_DIR=str(tmp_path),
               LD_LIBRARY_PATH=os.path.dirname(lib) + os.pathsep + os.environ.get("LD_LIBRARY_PATH", ""))
    for k in ("PYTHONPATH",) + tuple(drop):
        env.pop(k, None)
    env.update(extra_env)
    procs = [subprocess.Popen([sys.executable, os.path.join(here, "child_fakegpu.py"), lib, scenario],
                              env=dict(env, FAKE_RANK=str(r)), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = []
    try:
        for p in procs:
            try:
                out, err = p.communicate(timeout=limit)
                outs.append((p.returncode, out, err))
            except subprocess.TimeoutExpired:
                p.kill()
                out, err = p.communicate()
                outs.append((f"killed after {limit} s", out, err))
    finally:
        for p in procs:
            p.kill()
    results = []
    for rank, (rc, out, err) in enumerate(outs):
        lines = [json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT ")]
        hung = "Timeout (0:" in err  # faulthandler's dump of a hang
        assert rc == 0 and lines and not hung, (
            f"rank {rank} of {scenario} {'hung' if hung else 'failed'} (rc {rc}):\n"
            f"{out[-3000:]}\n{err[-4000:]}")
        results.append((lines[0], err))
    return results
