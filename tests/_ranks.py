"""The tests' names for the one spawn harness, pyccl/bench/spawn.py (shared with pyccl.bench).

run_ranks(fn, world, ...) runs fn in one spawned process per rank and fails as soon as a rank
reports an error, dies, crashes at exit or outlives the deadline, killing every rank's process
group first; run_bounded(cmd, timeout) does the same for a command line that starts workers of
its own. See spawn.py for the details.
"""
from pyccl.bench.spawn import (  # noqa: F401
    describe_exit, kill_group as _kill_group, reserved_port, run_bounded, run_ranks)
