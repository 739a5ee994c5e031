"""`python -m fourfold ...` runs the command line (also what torchrun launches with `-m fourfold`)."""

import sys

from fourfold.cli import main

sys.exit(main())
