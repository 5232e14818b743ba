"""``python -m qualia``: the command line (:mod:`qualia.cli`)."""

import sys

from .cli.main import main

if __name__ == "__main__":
    sys.exit(main())
