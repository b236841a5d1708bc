"""Development shim: ``python cli.py ...`` runs the ``fp8export`` command from a checkout."""

import sys

from fp8export.cli import main

if __name__ == "__main__":
    sys.exit(main())
