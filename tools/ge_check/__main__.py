"""`python -m tools.ge_check` (tools/ge_check/__init__.py says what it checks)."""

import sys

from tools.ge_check.cli import main

sys.exit(main())
