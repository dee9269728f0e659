"""`python -m meshfit` runs the command line."""

import sys

from meshfit.cli import main

sys.exit(main())
