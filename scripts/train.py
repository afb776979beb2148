"""`accelerate launch scripts/train.py --config FILE [--resume latest]`: the same as `tuner train`."""

import sys

from tuner.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
