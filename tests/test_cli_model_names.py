"""The model names every ``keye`` command accepts work in Python too: ``from_pretrained("keye-tiny")`` loads the
embedded model, and an unknown name says what would work (``keye.load_tiny()``, a hub id, a directory)."""

from __future__ import annotations

import pytest

from keye import KeyeProcessor, KeyeVL
from keye.errors import KeyeConfigError, KeyeWeightsError
from keye.hub import TINY_DIR, resolve_pretrained


def test_from_pretrained_takes_keye_tiny():
    model = KeyeVL.from_pretrained("keye-tiny", torch_dtype="float32")
    proc = KeyeProcessor.from_pretrained("keye-tiny")
    reference = KeyeVL.from_pretrained(TINY_DIR, torch_dtype="float32")
    assert model.num_parameters() == reference.num_parameters()
    assert proc.variant == KeyeProcessor.from_pretrained(TINY_DIR).variant
    batch = proc([{"role": "user", "content": [{"type": "text", "text": "hi"}]}])
    assert model.generate(**batch, max_new_tokens=2, do_sample=False).shape[1] > batch["input_ids"].shape[1]


@pytest.mark.parametrize("loader, error", [(KeyeVL.from_pretrained, KeyeWeightsError),
                                           (KeyeProcessor.from_pretrained, KeyeConfigError)])
def test_an_unknown_name_points_at_what_works(loader, error):
    with pytest.raises(error) as info:
        loader("keye_tiny")
    message = str(info.value)
    assert message.startswith("keye_tiny: no such directory")
    assert "keye.load_tiny()" in message and "'keye-tiny'" in message and "hub id 'owner/name'" in message


def test_names_resolve_without_loading(tmp_path):
    assert resolve_pretrained("keye-tiny") == str(TINY_DIR)
    assert resolve_pretrained("Kwai-Keye/Keye-VL-1_5-8B") == "Kwai-Keye/Keye-VL-1_5-8B"  # fetched by the loader
    assert resolve_pretrained(tmp_path) == str(tmp_path)
    for bad in ("./missing", "/no/such/dir", "a/b/c", "owner/"):
        with pytest.raises(KeyeConfigError, match="no such directory"):
            resolve_pretrained(bad)
