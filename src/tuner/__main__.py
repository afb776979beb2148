"""`python -m tuner ...` and `accelerate launch -m tuner train ...`."""

import sys

from tuner.cli import main

sys.exit(main())
