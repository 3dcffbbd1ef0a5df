"""The reference fixtures are intact: every data file under tests/fixtures/golden matches golden/SHA256SUMS.

The golden tests compare keye with these files, so a silently altered fixture (a line-ending conversion, a
Git LFS pointer checked out in place of the file, a partial copy) would turn them into comparisons against
the wrong numbers. The checksums were taken from the files as copied from the official runs (see
tests/fixtures/README.md).
"""

from __future__ import annotations

import hashlib

from tests.paths import GOLDEN

SUMS = GOLDEN / "SHA256SUMS"


def _listed() -> dict[str, str]:
    out = {}
    for n, line in enumerate(SUMS.read_text().splitlines(), 1):
        digest, sep, name = line.partition("  ")
        assert sep and len(digest) == 64, f"{SUMS}:{n}: expected '<sha256>  <path>', got {line!r}"
        out[name] = digest
    return out


def test_every_golden_data_file_matches_its_checksum():
    listed = _listed()
    present = {
        p.relative_to(GOLDEN).as_posix()
        for p in GOLDEN.rglob("*")
        if p.is_file() and p.name not in ("README.md", "SHA256SUMS")
    }
    assert present == set(listed), (
        f"{SUMS} is out of date: unlisted files {sorted(present - set(listed))}, "
        f"missing files {sorted(set(listed) - present)}"
    )
    wrong = [name for name, digest in listed.items()
             if hashlib.sha256((GOLDEN / name).read_bytes()).hexdigest() != digest]
    assert not wrong, f"golden fixtures differ from {SUMS}: {wrong}"
