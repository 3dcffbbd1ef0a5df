"""Where the tests' fixtures live: inside the repository, so a plain clone runs the suite.

``tests/fixtures/golden`` holds the reference outputs of the official implementations (see its README).
"""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
FIXTURES = REPO_ROOT / "tests" / "fixtures"
GOLDEN = FIXTURES / "golden"
GOLDEN_PREVIEW = GOLDEN / "keye_preview_tiny"
GOLDEN_EVAL = GOLDEN / "eval"
