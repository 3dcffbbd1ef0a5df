"""Instruction-format checks: JSON (optionally against a JSON schema), fenced code, markdown, steps, length.

Each check returns 1.0 (the answer follows the instruction) or 0.0, judged on the *visible* answer: the text
after the reasoning blocks, or the content of the last ``<answer>`` block (``keye.rewards.text.visible_answer``).

- JSON: the whole answer is a JSON object or array, optionally inside one fenced block (```` ```json ````
  or a bare fence) with nothing around it; with a schema it must also validate (``jsonschema``).
- Code: at least one closed fenced block whose info string names the language (aliases: py/python,
  js/javascript, ts/typescript, c++/cpp, sh/bash/shell, ...; None = any language) with non-empty content;
  Python blocks must also parse (``ast.parse``) and JSON blocks must load.
- Markdown list: at least ``markdown_min_items`` consecutive lines that are ``-``/``*``/``+``/``1.``/``1)``
  items. Markdown table: a header row with ``|`` cells, a separator row of hyphen cells (optional ``:``, GFM) with
  the same number of cells, and at least one body row.
- Steps: the number of lines starting with ``Step k`` or ``k.`` / ``k)`` (optionally after ``#`` / ``**``) in
  the think block (or the visible answer when there is none) lies in ``[steps_min, steps_max]``.
- Length: the number of words of the visible answer (CJK characters count one each) lies in
  ``[length_min, length_max]``.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from keye.errors import KeyeConfigError, KeyeInputError

_LANG_ALIASES = {
    "py": "python",
    "python3": "python",
    "js": "javascript",
    "node": "javascript",
    "ts": "typescript",
    "c++": "cpp",
    "cc": "cpp",
    "cxx": "cpp",
    "sh": "bash",
    "shell": "bash",
    "zsh": "bash",
    "yml": "yaml",
    "rs": "rust",
    "golang": "go",
    "md": "markdown",
    "jsonc": "json",
}
_PARSE_LIMIT = 200_000  # ast/json parsing of larger blocks is refused (time and memory bound)

_LIST_ITEM = re.compile(r"[ \t]{0,6}(?:[-*+]|\d{1,4}[.)])[ \t]+\S")
_STEP_LINE = re.compile(r"[ \t]{0,6}(?:#{1,6}[ \t]*)?(?:\*\*)?[ \t]*(?:step[ \t]*\d{1,4}|\d{1,4}[.)])", re.IGNORECASE)
_TABLE_SEP_CELL = re.compile(r":?-+:?")

_SCHEMA_CACHE: dict[str, Any] = {}


def canonical_language(name: str) -> str:
    """Lower-cased language name with common aliases folded (``"Py"`` -> ``"python"``)."""
    key = name.strip().lower()
    return _LANG_ALIASES.get(key, key)


def compile_schema(schema: Any, where: str = "json_schema") -> Any:
    """A ``jsonschema`` validator for ``schema`` (cached); ``KeyeConfigError`` if the schema itself is invalid
    or the ``jsonschema`` package is missing."""
    try:
        import jsonschema
    except ImportError as err:
        raise KeyeConfigError(f"{where}: JSON schemas need the jsonschema package: pip install 'keye[eval]'") from err

    try:
        key = json.dumps(schema, sort_keys=True)
    except (TypeError, ValueError) as err:
        raise KeyeConfigError(f"{where}: schema is not JSON-serialisable: {err}") from err
    validator = _SCHEMA_CACHE.get(key)
    if validator is None:
        if not isinstance(schema, (dict, bool)):
            raise KeyeConfigError(f"{where}: a JSON schema must be an object or a boolean, got {type(schema).__name__}")
        cls = jsonschema.validators.validator_for(schema)
        try:
            cls.check_schema(schema)
        except jsonschema.SchemaError as err:
            raise KeyeConfigError(f"{where}: invalid JSON schema: {err.message}") from err
        validator = cls(schema)
        if len(_SCHEMA_CACHE) > 256:
            _SCHEMA_CACHE.clear()
        _SCHEMA_CACHE[key] = validator
    return validator


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """All closed fenced code blocks of ``text`` as ``(info_string_lowercased, content)``, in order.

    A fence is a line whose stripped text starts with three or more backticks; the block closes at the next
    line that is only backticks (at least as many). Unclosed blocks are dropped.
    """
    blocks: list[tuple[str, str]] = []
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        line = lines[i].strip()
        if line.startswith("```"):
            ticks = len(line) - len(line.lstrip("`"))
            info = line[ticks:].strip().lower()
            body: list[str] = []
            j = i + 1
            closed = False
            while j < len(lines):
                stripped = lines[j].strip()
                if stripped.startswith("`" * ticks) and not stripped.strip("`"):
                    closed = True
                    break
                body.append(lines[j])
                j += 1
            if closed:
                blocks.append((info, "\n".join(body)))
                i = j + 1
                continue
            break
        i += 1
    return blocks


def parse_json_answer(answer: str) -> tuple[bool, Any]:
    """``(True, value)`` if ``answer`` is a JSON object/array (bare or in one fenced block), else ``(False, None)``."""
    s = answer.strip()
    if not s or len(s) > _PARSE_LIMIT:
        return False, None
    if s.startswith("```"):
        blocks = fenced_blocks(s)
        if len(blocks) != 1 or blocks[0][0] not in ("", "json", "jsonc") or not s.endswith("```"):
            return False, None
        s = blocks[0][1].strip()
    try:
        value = json.loads(s)
    except (ValueError, RecursionError):
        return False, None
    if not isinstance(value, (dict, list)):
        return False, None
    return True, value


def check_json(answer: str, schema: Any = None) -> tuple[float, str]:
    """1.0 if ``answer`` is valid JSON (object/array) that satisfies ``schema`` (if given), else 0.0 + reason."""
    ok, value = parse_json_answer(answer)
    if not ok:
        return 0.0, "answer is not a JSON object or array"
    if schema is not None:
        validator = compile_schema(schema)
        try:
            error = next(iter(validator.iter_errors(value)), None)
        except RecursionError:
            return 0.0, "JSON too deeply nested to validate"
        if error is not None:
            return 0.0, f"JSON does not match the schema: {error.message[:200]}"
    return 1.0, ""


def _code_parses(language: str, code: str) -> bool:
    if len(code) > _PARSE_LIMIT:
        return False
    try:
        if language == "python":
            ast.parse(code)
        elif language == "json":
            json.loads(code)
    except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError):
        return False
    return True


def check_code(answer: str, language: str | None = None) -> tuple[float, str]:
    """1.0 if ``answer`` has a closed, non-empty fenced block in ``language`` (None = any) that parses."""
    want = canonical_language(language) if language else None
    reason = f"no non-empty fenced {want or 'code'} block"
    for info, code in fenced_blocks(answer):
        lang = canonical_language(info.split()[0]) if info.split() else ""
        if (want is not None and lang != want) or not code.strip():
            continue
        if _code_parses(lang, code):
            return 1.0, ""
        reason = f"the {lang or 'code'} block does not parse"
    return 0.0, reason


def check_markdown(answer: str, kind: str = "list", min_items: int = 2) -> tuple[float, str]:
    """1.0 if ``answer`` contains a markdown ``kind`` ("list" or "table"; rules in the module docstring)."""
    lines = answer.split("\n")
    if kind == "list":
        run = 0
        for line in lines:
            run = run + 1 if _LIST_ITEM.match(line[:64]) else 0
            if run >= min_items:
                return 1.0, ""
        return 0.0, f"no markdown list of >= {min_items} items"
    if kind == "table":
        for i in range(len(lines) - 2):
            header = _table_cells(lines[i])
            if header is None or len(header) < 1:
                continue
            sep = _table_cells(lines[i + 1])
            if sep is None or len(sep) != len(header) or not all(_TABLE_SEP_CELL.fullmatch(c) for c in sep):
                continue
            row = _table_cells(lines[i + 2])
            if row is not None and len(row) == len(header):
                return 1.0, ""
        return 0.0, "no markdown table (header, separator and a body row)"
    raise KeyeInputError(f"markdown kind must be 'list' or 'table', got {kind!r}")


def _table_cells(line: str) -> list[str] | None:
    s = line.strip()
    if "|" not in s or len(s) > 10_000:
        return None
    if s.startswith("|"):
        s = s[1:]
    if s.endswith("|"):
        s = s[:-1]
    return [c.strip() for c in s.split("|")]


def count_steps(text: str) -> int:
    """Number of lines of ``text`` that start a reasoning step (``Step 3``, ``3.``, ``3)``, ``### Step 3``)."""
    return sum(1 for line in text.split("\n") if _STEP_LINE.match(line[:64]))


def in_window(value: int, low: int, high: int | None) -> bool:
    """``low <= value <= high`` with ``high=None`` meaning unbounded."""
    return value >= low and (high is None or value <= high)
