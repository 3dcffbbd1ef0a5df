"""``python -m keye`` is the ``keye`` command (so ``torchrun -m keye train ...`` works)."""

import sys

from keye.cli import main

sys.exit(main())
