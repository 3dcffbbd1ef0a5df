"""The Gradio demo end to end: a real server on a free port, driven by gradio_client and headless Chromium."""

from __future__ import annotations

import re
import shutil
import socket
import time
from pathlib import Path

import numpy as np
import pytest

from keye.demo.app import markdown_safe
from keye.demo.engine import ModelHost
from keye.demo.session import ChatSession, VideoSettings, split_partial
from tests.system import need_system

QUESTION = "Which way does the square move?"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tiny_ckpt):
    from keye.demo.app import build_app, serve

    host = ModelHost(str(tiny_ckpt), device="cpu").start()
    app = build_app(host)
    port = _free_port()
    serve(app, port=port, block=False)
    yield f"http://127.0.0.1:{port}/", host
    app.close()


def _client(url):
    from gradio_client import Client

    return Client(url, verbose=False)


def _text(message) -> str:
    content = message["content"]
    if isinstance(content, list):
        return "".join(c.get("text", "") for c in content if isinstance(c, dict))
    return content


def _ask(client, path, question=QUESTION, **kw):
    from gradio_client import handle_file

    return client.submit(files=[handle_file(str(path))], question=question, api_name="/respond", **kw)


@pytest.mark.slow
def test_video_question_streams_the_greedy_answer(server, clip):
    url, host = server
    job = _ask(_client(url), clip, max_new_tokens=12)
    chat, alert, gallery, summary, question = job.result(timeout=300)
    assert [m["role"] for m in chat][0] == "user" and _text(chat[0]) == QUESTION
    full = _text(chat[-1])
    assert chat[-1]["role"] == "assistant"
    # Under the answer: the mode the model chose and the tokens it generated (the summary's count).
    answer, _, footer = full.partition("\n\n<sub>")
    generated = int(re.search(r"\*\*Generated:\*\* (\d+) tokens", summary).group(1))
    assert re.fullmatch(rf"mode: .+ · {generated} tokens?( \(\d+ thinking\))?</sub>", footer), footer

    # Same answer as a plain greedy generate on the same messages (the page's default settings).
    proc, model = host.processor, host.model
    batch = proc(ChatSession(media=[("video", str(clip))]).messages(QUESTION, VideoSettings()), mode="auto")
    out = model.generate(**batch, max_new_tokens=12, do_sample=False)
    expected = markdown_safe(split_partial(proc.decode(out[0, batch["input_ids"].shape[1] :])).answer) or "*(no answer)*"
    assert answer == expected

    # Streamed: several intermediate updates whose text grows towards the final answer.
    partial = [_text(o[0][-1]) for o in job.outputs() if o[0] and o[0][-1]["role"] == "assistant"]
    growing = [t for t in dict.fromkeys(partial) if t not in ("…", answer, full)]
    assert len(growing) >= 2 and all(answer.startswith(t) for t in growing)

    # The gallery shows the 6 sampled frames (3 s at 2 fps) with timestamp, slow/fast and tokens.
    assert len(gallery) == len(batch.video_meta[0].indices) == 6
    captions = [g["caption"] for g in gallery]
    assert captions[0].startswith("0.0 s · slow · ") and captions[1].startswith("0.6 s · fast · ")
    assert f"{batch.video_meta[0].tokens:,} visual" in summary and "Generated:" in summary
    assert question == ""


def _alert_text(alert) -> str:
    return alert["value"] if isinstance(alert, dict) else alert


@pytest.mark.slow
def test_bad_uploads_get_a_message_and_the_server_keeps_serving(server, clip, corrupt_clip, tmp_path):
    url, _ = server
    client = _client(url)
    notes = tmp_path / "notes.txt"
    notes.write_text("not a video")
    long_ok = _ask(client, clip, max_new_tokens=4)  # queued alongside the bad ones
    bad = _ask(client, corrupt_clip).result(timeout=300)
    assert "broken.mp4: unreadable, truncated or corrupt video" in _alert_text(bad[1])
    wrong = _ask(client, notes).result(timeout=300)
    assert "notes.txt: unsupported file type '.txt'" in _alert_text(wrong[1])
    assert wrong[4] == QUESTION  # the question stays in the box to retry with another file
    good = long_ok.result(timeout=300)
    assert good[0][-1]["role"] == "assistant" and _text(good[0][-1])
    again = _ask(client, clip, max_new_tokens=4).result(timeout=300)
    assert again[0][-1]["role"] == "assistant" and len(again[2]) == 6
    # Images work too: one gallery entry per image.
    from PIL import Image

    img = tmp_path / "red.png"
    Image.new("RGB", (80, 60), (220, 40, 40)).save(img)
    pic = _ask(client, img, question="What colour is it?", max_new_tokens=4).result(timeout=300)
    assert _text(pic[0][0]) == "What colour is it?" and len(pic[2]) == 1
    assert pic[2][0]["caption"].startswith("image 0 · image · ")


# Every gallery caption whose text does not fit its box (Gradio cuts it with an ellipsis).
CUT_CAPTIONS = """[...document.querySelectorAll('.keye-gallery .caption-label')]
    .filter(e => e.scrollWidth > e.clientWidth + 1 || e.scrollHeight > e.clientHeight + 1)
    .map(e => e.innerText)"""


@pytest.mark.slow
def test_screenshot_after_an_answer(server, tmp_path):
    from PIL import Image

    from keye.demo.screenshot import BROWSERS, HeadlessPage

    need_system("chromium", any(shutil.which(b) for b in BROWSERS), "the demo screenshot test")
    url, _ = server
    with HeadlessPage(url + "?example=0&ask=1") as page:
        page.wait_for_text("Generated:", timeout=180)
        time.sleep(1.0)
        captions = page.evaluate("[...document.querySelectorAll('.keye-gallery .caption-label')].map(e => e.innerText)")
        assert captions and captions[0].startswith("0.0 s · slow · "), captions
        assert page.evaluate(CUT_CAPTIONS) == []  # every frame's label is shown whole
        png = page.capture(tmp_path / "demo.png")
    img = Image.open(png).convert("RGB")
    assert img.size == (1280, 1600)
    arr = np.asarray(img, dtype=np.float64)
    assert arr.std() > 20  # not blank: text, sliders and the frame gallery
    # The gallery's dark synthetic frames are on the page (the example clip's background is (24, 24, 28)).
    dark = (np.abs(arr - [24, 24, 28]).max(axis=2) < 12).mean()
    assert dark > 0.01


EXAMPLE_ROWS = "[...document.querySelectorAll('#keye-examples tbody tr')]"
QUESTION_BOX = "document.querySelector('textarea[placeholder^=\"Ask about the video\"]')"


@pytest.mark.slow
def test_an_example_clicked_right_after_load_is_kept(server):
    """A mouse click on an example as soon as the page shows the examples reaches the table (Gradio's
    translucent "Loading..." sheet over the page lets it through) and fills the question and the files, and
    nothing the page does while it finishes loading undoes it."""
    from keye.demo.examples import load_examples
    from keye.demo.screenshot import BROWSERS, HeadlessPage

    need_system("chromium", any(shutil.which(b) for b in BROWSERS), "the demo's example-click test")
    url, _ = server
    examples = load_examples()
    with HeadlessPage(url) as page:
        deadline = time.monotonic() + 60
        while not page.evaluate(EXAMPLE_ROWS + ".length"):
            assert time.monotonic() < deadline, page.text()[-500:]
            time.sleep(0.02)
        where = ("(() => { const r = " + EXAMPLE_ROWS + f"[{len(examples) - 1}].getBoundingClientRect();"
                 " return [r.x + r.width / 2, r.y + r.height / 2]; })()")
        # Click where a person would: on the row once it has stopped moving (components above it still grow
        # while their code loads), a fraction of a second after it appeared.
        x, y = page.evaluate(where)
        while True:
            time.sleep(0.15)
            now = page.evaluate(where)
            if now == [x, y]:
                break
            assert time.monotonic() < deadline, "the examples never stopped moving"
            x, y = now
        hit = page.evaluate(f"(() => {{ const e = document.elementFromPoint({x}, {y}); "
                            "return !!(e && e.closest('#keye-examples')); })()")
        for kind in ("mousePressed", "mouseReleased"):
            page.call("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1)
        time.sleep(4.0)  # the page's own load events have finished by now
        assert hit, "something covers the examples right after the page shows them"
        assert page.evaluate(QUESTION_BOX + ".value") == examples[-1]["question"]
        files = page.evaluate("document.querySelector('#keye-files').innerText")
        assert Path(examples[-1]["video"]).stem in files, files
