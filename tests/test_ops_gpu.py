"""GPU tier of pyccl's torch custom ops (pyccl/ops.py) and of torch.compile over pyccl.

Every GPU of the machine is a rank, at least 2 (they share a GPU where there is one), each its own process (tests/_ranks.py),
bounded in time; "nccl" over the same processes is the oracle.  Data are integer-valued,
exact after any reduction, so every comparison is bitwise.
- every op on a "pyccl" group, on its Communicator and on its name, against "nccl";
- torch.compile(fullgraph=True), then mode="reduce-overhead" (CUDA graphs, replayed without
  running the ops' Python), equal to eager; torch's functional collectives and dist.all_reduce
  on the "pyccl" group compiled the same ways, against eager on "nccl";
- examples/08_compile_tp.py (a tensor-parallel MLP) and examples/07_fsdp2.py run to their OK line.
"""
import os
import sys

from conftest import gpu_count, needs_gpus
from _ranks import run_bounded, run_ranks
import _ops_scenarios as os_

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _world():
    """Every GPU a rank, and at least 2 ranks (sharing the GPU where there is one)."""
    return max(2, min(gpu_count(), 8))


@needs_gpus(1)
def test_every_op_against_nccl(tmp_path):
    world = _world()
    res = run_ranks(os_.every_op_vs_nccl, world, str(tmp_path / "store"), make_comm=False, timeout=420)
    # 3 handles x 3 sizes x (int32: 4 reductions, float32: 5, bfloat16: 4 or 5) x 3 + 4 each, + 1
    assert all(n >= 3 * 3 * ((4 + 5 + 4) * 3 + 3 * 4) + 1 for n in res.values()), res


@needs_gpus(1)
def test_compiled_fullgraph_and_cuda_graphs_equal_eager(tmp_path):
    world = _world()
    # (ends with destroy_process_group: NCCL's destroy waits for the CUDA graphs that captured the
    # group's work, which the backend frees first; a hang there fails at the harness's deadline)
    res = run_ranks(os_.compiled_equals_eager, world, str(tmp_path / "store"), make_comm=False, timeout=240)
    assert all(n == 2 * (1 + 6) + 2 * 4 for n in res.values()), res


def _example(name, expect):
    r = run_bounded([sys.executable, os.path.join(ROOT, "examples", name)], timeout=420,
                    env=dict(os.environ, PYTHONPATH=ROOT, RANKS=str(_world())), cwd=ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    last = r.stdout.splitlines()[-1]
    assert last.startswith(expect), r.stdout
    return last


@needs_gpus(1)
def test_example_08_compile_tp():
    _example("08_compile_tp.py", "OK: tensor-parallel MLP over ")


@needs_gpus(1)
def test_example_07_fsdp2():
    _example("07_fsdp2.py", "OK: FSDP2 over ")
