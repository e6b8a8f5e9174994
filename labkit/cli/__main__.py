"""`python -m labkit.cli`: the command line, as the `labkit` script runs it."""

import sys

from labkit.cli import main

sys.exit(main())
