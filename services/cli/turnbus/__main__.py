"""``python -m turnbus ...`` is ``turnbus ...``."""

from __future__ import annotations

import sys

from turnbus.cli import main

if __name__ == "__main__":
    sys.exit(main())
