"""Launch the Keye-VL video Q&A demo (same as ``keye demo``).

.venv/bin/python demo/app.py                      # embedded keye-tiny on http://127.0.0.1:7860
.venv/bin/python demo/app.py --model Kwai-Keye/Keye-VL-1_5-8B --host 0.0.0.0
"""

from __future__ import annotations

import sys

from keye.cli import main

if __name__ == "__main__":
    sys.exit(main(["demo", *sys.argv[1:]]))
