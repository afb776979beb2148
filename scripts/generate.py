"""`python scripts/generate.py --config FILE --prompt ... --out x.mp4`: the same as `tuner generate`."""

import sys

from tuner.cli import main

if __name__ == "__main__":
    sys.exit(main(["generate", *sys.argv[1:]]))
