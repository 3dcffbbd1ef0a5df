"""Evaluate a model on mathvista (thin script over ``keye eval mathvista``; see keye/eval/cli.py for the options).

Usage: python eval/mathvista.py --model PATH --out runs/mathvista [...]
"""

from __future__ import annotations

import sys

from keye.eval.cli import script_main

if __name__ == "__main__":
    sys.exit(script_main("mathvista"))
