"""``python -m mergelab``: the ``mergelab`` command."""

import sys

from mergelab.cli import main

if __name__ == "__main__":
    sys.exit(main())
