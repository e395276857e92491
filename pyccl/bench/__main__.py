"""`python -m pyccl.bench`: see pyccl.bench.cli for the flags."""
import sys

from pyccl.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
