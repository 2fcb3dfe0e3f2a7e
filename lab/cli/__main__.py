"""`python -m lab.cli`: the `lab` command (the tests and the sweep's worker processes start it so)."""

import sys

from lab.cli import main

sys.exit(main())
