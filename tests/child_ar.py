"""One rank of a short own-kernel run, for compute-sanitizer: child_ar.py RANK WORLD UID_HEX."""
import sys

import torch

import pyccl


def main():
    rank, world, uid = int(sys.argv[1]), int(sys.argv[2]), bytes.fromhex(sys.argv[3])
    pyccl.place_rank(rank, world)
    comm = pyccl.Communicator(world, uid, rank)
    dev = f"cuda:{comm.device}"
    for algo in ("oneshot", "twoshot"):
        for count in (5, 1000, 40000 + 3):
            for dtype in (torch.float32, torch.bfloat16, torch.int32):
                x = (torch.arange(count) % 100 + rank).to(dtype).to(dev)
                comm.all_reduce(x, algo=algo)
                want = sum((torch.arange(count) % 100 + q).to(torch.float64) for q in range(world)).to(dtype)
                torch.cuda.synchronize()
                assert torch.equal(x.cpu(), want), (algo, count, dtype)
    comm.destroy()
    print("AR CHILD OK", flush=True)


if __name__ == "__main__":
    main()
