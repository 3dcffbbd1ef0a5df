"""``import keye`` stays cheap (no torch, no transformers) and still registers the auto classes."""

from __future__ import annotations

import subprocess
import sys

REGISTERED = (
    "from transformers.models.auto.configuration_auto import CONFIG_MAPPING; "
    "assert 'Keye' in CONFIG_MAPPING and 'KeyeVL1_5' in CONFIG_MAPPING, sorted(CONFIG_MAPPING)[:5]"
)


def _run(code: str) -> None:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]


def test_import_keye_loads_neither_torch_nor_transformers():
    # Reward workers, data-loader processes and the command line import keye; they must not pay seconds of
    # torch + transformers imports for it.
    _run("import sys, keye; heavy = {'torch', 'transformers'} & set(sys.modules); assert not heavy, heavy")


ORDERS = (
    "import keye; import transformers",
    "import transformers; import keye",
    "import keye.config",  # keye's own module imports transformers half-way through its own import
    "from keye.processing.processor import KeyeProcessor",
    "from keye import KeyeVL",
)


def test_auto_classes_are_registered_in_any_import_order():
    # every order in a fresh interpreter of its own; the interpreters run side by side (each spends its seconds
    # importing transformers), and every failing order is reported with its stderr
    procs = {first: subprocess.Popen([sys.executable, "-c", f"{first}; {REGISTERED}"], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True) for first in ORDERS}
    failed = {}
    for first, proc in procs.items():
        _, err = proc.communicate(timeout=300)
        if proc.returncode != 0:
            failed[first] = err[-2000:]
    assert not failed, failed
