"""Evaluate a model on mmmu (thin script over ``keye eval mmmu``; see keye/eval/cli.py for the options).

Usage: python eval/mmmu.py --model PATH --out runs/mmmu [...]
"""

from __future__ import annotations

import sys

from keye.eval.cli import script_main

if __name__ == "__main__":
    sys.exit(script_main("mmmu"))
