"""`python -m gyre` is the `gyre` command."""

import sys

from gyre.cli import main

sys.exit(main())
