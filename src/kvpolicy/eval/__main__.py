"""``python -m kvpolicy.eval``: the same command as ``kvpolicy eval``."""

import sys

from .cli import main

sys.exit(main())
