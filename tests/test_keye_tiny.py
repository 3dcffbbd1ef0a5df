"""The embedded default keye-tiny loads offline and answers held-out synthetic questions in the trained
answer format (an option-shaped phrase for multiple choice, the option's text when it names one; a plain
number otherwise)."""

from __future__ import annotations

import pytest

from keye import load_tiny
from keye.data.synth import COLORS, DIRECTIONS, SHAPES, generate
from keye.eval.runner import KeyeEngine
from keye.eval.synth import build_conversation, extract, load_items

OPTION_WORDS = {"the", *COLORS, *SHAPES, *DIRECTIONS}


@pytest.fixture(scope="module")
def tiny():
    return load_tiny()


def test_keye_tiny_loads_offline_and_is_small(tiny):
    model, proc = tiny
    assert model.config.variant == "1.5" and 1e6 < model.num_parameters() < 1e7
    assert proc.image_processor.config.video_defaults["floor_pixels"] == 3136
    assert proc.token_ids["<|frame|>"] == 512


@pytest.mark.slow
def test_keye_tiny_answers_held_out_questions_in_format(tiny, tmp_path):
    # The test split is a pure function of (seed, split, index): these are the first items of
    # data/synth/test.jsonl, which keye-tiny never saw in training.
    items = load_items(generate(tmp_path, train=0, test=24, seed=0, workers=1, progress=False)["test"])
    model, proc = tiny
    answers = KeyeEngine(model, proc, batch_size=12, max_new_tokens=6).generate(
        [build_conversation(it) for it in items]
    )
    for answer, item in zip(answers, items):
        text = answer.strip()
        if item["answer_kind"] == "mc":
            # an option-shaped phrase: as many words as the options, each one the set uses in options
            # ("the blue circle" when the options are "the red circle" / "the blue triangle" is in format
            # but names no option, which the scorer counts wrong)
            words = text.split(" ")
            assert len(words) == len(item["choices"][0].split(" ")) and set(words) <= OPTION_WORDS, (text, item)
            if text in item["choices"]:
                assert extract(answer, item) == "ABCDEFGH"[item["choices"].index(text)]
        else:
            assert float(text) >= 0, (text, item["id"])
            assert extract(answer, item) is not None


def test_resolve_model_path_names_the_embedded_default(tmp_path):
    from keye.tiny import TINY_DIR, resolve_model_path

    assert resolve_model_path("keye-tiny") == str(TINY_DIR)
    assert (TINY_DIR / "config.json").is_file()
    assert resolve_model_path(tmp_path) == str(tmp_path)  # directories and hub ids pass through
    assert resolve_model_path("Kwai-Keye/Keye-VL-1_5-8B") == "Kwai-Keye/Keye-VL-1_5-8B"
