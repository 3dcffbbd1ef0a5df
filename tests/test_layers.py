"""The layering of docs/architecture.md ("Layers"), checked over keye's import graph.

Every import counts, the function-local (lazy) ones included: a lazy import upward still ties a lower layer to an
upper one. The graph is read from the source with :mod:`ast`, so the test needs nothing importable and names the
file and line of each offending import.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

KEYE = Path(__file__).resolve().parents[1] / "keye"

# Old import paths of the recipes, kept for user code: nothing inside keye may use them.
ALIASES = {"keye.train.sft", "keye.train.rlep"}
RECIPES = ("keye.recipes",) + tuple(ALIASES)
BOTTOM = ("keye.errors", "keye.config", "keye.hub", "keye.model", "keye.processing", "keye.data", "keye.rewards")
FLOOR = ("keye.train",)
LIBRARIES = ("keye.sft", "keye.rl")
APPS = ("keye.eval", "keye.serve", "keye.demo", "keye.cli", "keye.tiny")
# keye.rl's sub-packages by role, lowest first: each imports only those before it (config.py is the recipe's
# schema, at the level of the loop; the package's __init__ and cli.py are its facade).
RL_ORDER = ("keye.rl.rollout", "keye.rl.algorithms", "keye.rl.learner", "keye.rl.config", "keye.rl.loop",
            "keye.rl.distributed")


def module_name(path: Path, root: Path = KEYE) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, root: Path = KEYE) -> list[tuple[str, int]]:
    """Every module ``path`` imports (``from a.b import c`` counts as ``a.b`` and ``a.b.c``), with its line."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            out.append((base, node.lineno))
            out += [(f"{base}.{a.name}", node.lineno) for a in node.names]
    return out


def graph(root: Path = KEYE) -> dict[str, list[tuple[str, int, Path]]]:
    """keye module -> the keye modules it imports (with line and file); ``root`` is the ``keye`` package folder."""
    out: dict[str, list[tuple[str, int, Path]]] = {}
    for path in sorted(root.rglob("*.py")):
        out[module_name(path, root)] = [(m, line, path.relative_to(root.parent)) for m, line in imports(path, root)
                                        if m == "keye" or m.startswith("keye.")]
    return out


def within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def violations(rules: list[tuple[tuple[str, ...], tuple[str, ...], str]],
               g: dict[str, list[tuple[str, int, Path]]] | None = None) -> list[str]:
    """``rules``: (importers, forbidden targets, why); every import of a forbidden target by an importer, as
    ``file:line: importer imports target (why)``."""
    g = graph() if g is None else g
    found: dict[tuple[str, int, str], str] = {}  # one report per import statement and rule
    for mod, targets in g.items():
        for src, dst, why in rules:
            if not within(mod, src) or mod in ALIASES:
                continue
            for target, line, path in targets:
                if within(target, dst):
                    found.setdefault((str(path), line, why), f"{path}:{line}: {mod} imports {target} ({why})")
    return sorted(found.values())


RULES = [
    (("keye.rl",), RECIPES, "keye/rl never imports a recipe module"),
    (("keye.data",), ("keye.eval",), "the data package never imports evaluation"),
    (("keye.processing",), ("keye.tiny", "keye.testing"), "processing never imports the tiny model"),
    (BOTTOM, FLOOR + LIBRARIES + RECIPES + APPS + ("keye.testing",), "the bottom layer imports nothing above it"),
    (("keye.rewards",), ("keye.model", "keye.processing", "keye.data"), "rewards, the lowest, imports no other bottom package"),
    (("keye.hub",), ("keye.model", "keye.processing", "keye.data", "keye.rewards"), "hub only resolves model names"),
    (FLOOR, LIBRARIES + RECIPES, "the training floor imports no library or recipe"),
    (("keye.sft",), ("keye.rl",) + RECIPES, "the SFT library imports neither RL nor a recipe"),
    (("keye.rl",), ("keye.sft",), "the RL library does not import the SFT library"),
    (("keye",), tuple(ALIASES), "the old recipe paths are for user code only"),
] + [((lower,), RL_ORDER[i + 1:], f"{lower} sits below {', '.join(RL_ORDER[i + 1:])}")
     for i, lower in enumerate(RL_ORDER[:-1])]


def test_every_rule_of_the_layering_holds():
    bad = violations(RULES)
    assert not bad, "imports against docs/architecture.md's layers:\n" + "\n".join(bad)


def test_the_graph_sees_lazy_and_relative_imports(tmp_path):
    """The checker is not vacuous: a function-local import upward and a relative one are both caught."""
    pkg = tmp_path / "keye"
    (pkg / "rl").mkdir(parents=True)
    (pkg / "data").mkdir()
    (pkg / "rl" / "x.py").write_text("def f():\n    from keye.recipes.rlep import train\n")
    (pkg / "data" / "y.py").write_text("from ..eval import runner\n")
    g = graph(pkg)
    bad = violations(RULES, g)
    assert any("keye.rl.x imports keye.recipes.rlep" in b for b in bad)
    assert any("keye.data.y imports keye.eval" in b for b in bad)


@pytest.mark.parametrize("alias, home", [("keye.train.sft", "keye.recipes.sft"), ("keye.train.rlep", "keye.recipes.rlep")])
def test_old_recipe_paths_keep_working(alias, home):
    import importlib

    old, new = importlib.import_module(alias), importlib.import_module(home)
    assert old.train is new.train and old.main is new.main and old.run_from_args is new.run_from_args
