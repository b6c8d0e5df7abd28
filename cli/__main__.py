"""`python -m starfed.cli` runs the command line."""

import sys

from starfed.cli import main

sys.exit(main())
