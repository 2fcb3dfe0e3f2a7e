"""`python -m lab.cli`: the `lab` command (the tests and the sweep's worker processes start it so)."""

from lab import exit_now
from lab.cli import main

exit_now(main())
