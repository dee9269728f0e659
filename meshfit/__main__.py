"""`python -m meshfit` runs the command line."""

import sys

import meshfit

meshfit._stop_on_ctrl_c_while_starting()  # before meshfit.cli is imported

from meshfit.cli import main  # noqa: E402

sys.exit(main())
