"""`python -m lily ...` runs the `lily` command line."""

import sys

from lily.cli import main

sys.exit(main())
