"""Run pyccl's benchmark (python -m pyccl.bench) over every local GPU.

Default: all_reduce from 8 B to 128 MB, pyccl side by side with
torch.distributed and torch.cuda.nccl.  --quick: a short checked sweep.
Other arguments go to pyccl.bench (see python -m pyccl.bench --help).
"""
import sys

import torch

from pyccl.bench.cli import main as bench_main


def main():
    n = torch.cuda.device_count()
    if n == 0:
        sys.exit("04_benchmark: no CUDA GPU found")
    args = sys.argv[1:]
    if "--quick" in args:
        args.remove("--quick")
        args = ["-b", "8", "-e", "1M", "-f", "16", "-n", "10", "-w", "3", "-c", "1"] + args
    elif not args:
        args = ["-b", "8", "-e", "128M", "-f", "8", "--compare"]
    if not any(a in ("-g", "--ngpus") for a in args):
        args = ["-g", str(n)] + args
    rc = bench_main(args)
    if rc:
        sys.exit(rc)
    print("OK")


if __name__ == "__main__":
    main()
