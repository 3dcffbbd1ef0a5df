"""The bottom layer (keye.model, keye.processing, keye.data, keye.rewards, keye.hub) never imports the layers
above it (evaluation, serving, the demo, keye.tiny, the test helpers, training), and keye.rewards, the lowest
of them, imports none of the others: read from the source, so a lazy import inside a function counts too."""

from __future__ import annotations

import ast
from pathlib import Path

import keye

ROOT = Path(keye.__file__).resolve().parent
ABOVE = ("keye.eval", "keye.serve", "keye.demo", "keye.tiny", "keye.testing", "keye.train", "keye.rl",
         "keye.recipes", "keye.sft", "keye.cli")
RULES = {
    "model": ABOVE,
    "processing": ABOVE,
    "data": ABOVE,
    "rewards": ABOVE + ("keye.model", "keye.processing", "keye.data"),
    "hub.py": ABOVE + ("keye.model", "keye.processing", "keye.data", "keye.rewards"),
}


def _imports(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.append((node.lineno, node.module))
    return out


def test_bottom_layer_imports_nothing_above_it() -> None:
    bad = []
    for name, banned in RULES.items():
        target = ROOT / name
        for path in sorted([target] if target.is_file() else target.rglob("*.py")):
            for line, module in _imports(path):
                if any(module == b or module.startswith(b + ".") for b in banned):
                    bad.append(f"{path.relative_to(ROOT.parent)}:{line} imports {module}")
    assert not bad, "\n".join(bad)
