"""``keye serve`` end to end: the real ``openai`` client against a live server on keye-tiny."""

from __future__ import annotations

import base64
import http.server
import json
import threading
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tests.serve.conftest import free_port

QUESTION = "What colour is the object?"


def _reference(tiny, content, max_new_tokens=16, mode=None) -> str:
    """Greedy answer computed directly with the model and processor (no server)."""
    model, proc = tiny
    batch = proc([{"role": "user", "content": content}], mode=mode)
    ids = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False)
    return proc.decode(ids[0, batch["input_ids"].shape[1]:], skip_special_tokens=True)


def _text(q: str = QUESTION):
    return {"type": "text", "text": q}


def test_models_lists_the_served_model(client):
    ids = [m.id for m in client.models.list().data]
    assert ids == ["keye-tiny"]


def test_text_completion_equals_direct_generation(client, tiny):
    r = client.chat.completions.create(model="keye-tiny", messages=[{"role": "user", "content": "Say hello."}],
                                       max_tokens=12, temperature=0)
    expected = _reference(tiny, [_text("Say hello.")], max_new_tokens=12)
    choice = r.choices[0]
    assert choice.message.content == expected
    assert choice.finish_reason in ("stop", "length")
    n_prompt = tiny[1]([{"role": "user", "content": [_text("Say hello.")]}])["input_ids"].shape[1]
    assert r.usage.prompt_tokens == n_prompt
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert 1 <= r.usage.completion_tokens <= 12


def test_streaming_equals_non_streaming(client, tiny, media_dir):
    content = [{"type": "video_url", "video_url": {"url": str(media_dir / "clip.mp4")}}, _text()]
    full = client.chat.completions.create(model="keye-tiny", messages=[{"role": "user", "content": content}],
                                          max_tokens=16, temperature=0)
    stream = client.chat.completions.create(model="keye-tiny", messages=[{"role": "user", "content": content}],
                                            max_tokens=16, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    pieces, reasons, usage = [], [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            if ch.delta.content:
                pieces.append(ch.delta.content)
            if ch.finish_reason:
                reasons.append(ch.finish_reason)
    assert "".join(pieces) == full.choices[0].message.content
    assert reasons == [full.choices[0].finish_reason]
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens


def test_video_by_local_path_equals_direct_generation(client, tiny, media_dir):
    clip = str(media_dir / "clip.mp4")
    r = client.chat.completions.create(
        model="keye-tiny", max_tokens=16, temperature=0,
        messages=[{"role": "user", "content": [{"type": "video_url", "video_url": {"url": clip}}, _text()]}],
    )
    expected = _reference(tiny, [{"type": "video", "video": clip, "max_frames": 16}, _text()])
    assert r.choices[0].message.content == expected


def test_image_as_data_uri(client, tiny, media_dir):
    png = (media_dir / "red.png").read_bytes()
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    r = client.chat.completions.create(
        model="keye-tiny", max_tokens=12, temperature=0,
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, _text()]}],
    )
    expected = _reference(tiny, [{"type": "image", "image": str(media_dir / "red.png")}, _text()], 12)
    assert r.choices[0].message.content == expected


@pytest.fixture(scope="module")
def http_media(media_dir):
    """A loopback HTTP server over ``media_dir`` (for http:// media URLs)."""
    handler = lambda *a, **k: http.server.SimpleHTTPRequestHandler(*a, directory=str(media_dir), **k)  # noqa: E731
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.RequestHandlerClass.log_message = lambda *a, **k: None
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def test_video_over_http(client, tiny, media_dir, http_media):
    r = client.chat.completions.create(
        model="keye-tiny", max_tokens=16, temperature=0,
        messages=[{"role": "user", "content": [
            {"type": "video_url", "video_url": {"url": f"{http_media}/clip.mp4", "fps": 5}}, _text()]}],
    )
    expected = _reference(tiny, [{"type": "video", "video": str(media_dir / "clip.mp4"), "fps": 5.0,
                                  "max_frames": 16}, _text()])
    assert r.choices[0].message.content == expected


def test_n_choices_with_seed_are_reproducible(client):
    kw = dict(model="keye-tiny", messages=[{"role": "user", "content": "Name a colour."}], max_tokens=10,
              temperature=2.0, n=2, seed=1234)
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert a.usage.completion_tokens == b.usage.completion_tokens
    # Other seeds sample other answers (at temperature 2 keye-tiny is far from deterministic).
    others = {tuple(c.message.content for c in client.chat.completions.create(**{**kw, "seed": s}).choices)
              for s in (1, 2, 3)}
    assert len(others | {tuple(c.message.content for c in a.choices)}) > 1


def test_stop_string_cuts_the_answer(client, media_dir):
    # keye-tiny answers its caption prompt with a long sentence; greedy makes it reproducible.
    from keye.data.synth import CAPTION_PROMPT

    prompt = CAPTION_PROMPT.format(kind="video", times=", the second it appears and what it does")
    content = [{"type": "video_url", "video_url": {"url": str(media_dir / "clip.mp4")}}, _text(prompt)]
    kw = dict(model="keye-tiny", messages=[{"role": "user", "content": content}], max_tokens=32, temperature=0)
    full = client.chat.completions.create(**kw).choices[0].message.content
    assert len(full) >= 6, f"keye-tiny's sampled answer {full!r} is too short to test stop strings"
    stop = full[3:5]
    cut = full[: full.find(stop)]
    r = client.chat.completions.create(**kw, stop=[stop])
    assert r.choices[0].message.content == cut
    assert r.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(**kw, stop=[stop], stream=True))
    assert "".join(ch.delta.content or "" for chunk in chunks for ch in chunk.choices) == cut
    assert [ch.finish_reason for chunk in chunks for ch in chunk.choices if ch.finish_reason] == ["stop"]


def test_eight_concurrent_clients_are_batched(client, live, media_dir):
    before = dict(live.server.engine.stats)
    questions = [f"Question {i}: what is in the clip?" for i in range(8)]

    def ask(q):
        return client.chat.completions.create(
            model="keye-tiny", max_tokens=8, temperature=0,
            messages=[{"role": "user", "content": [
                {"type": "video_url", "video_url": {"url": str(media_dir / "clip.mp4")}}, _text(q)]}])

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(ask, questions))
    assert len(results) == 8
    assert all(r.choices[0].finish_reason in ("stop", "length") for r in results)
    stats = live.server.engine.stats
    assert stats["requests"] - before["requests"] == 8
    # Batching happened: fewer model batches than requests.
    assert stats["batches"] - before["batches"] < 8


@pytest.fixture(scope="module")
def text_server(tmp_path_factory):
    """A loopback HTTP server whose notes.mp4 is a text file: not a video whatever its name says."""
    d = tmp_path_factory.mktemp("http_text")
    (d / "notes.mp4").write_text("meeting notes, not a video\n" * 20)
    handler = lambda *a, **k: http.server.SimpleHTTPRequestHandler(*a, directory=str(d), **k)  # noqa: E731
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.RequestHandlerClass.log_message = lambda *a, **k: None
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield httpd.server_address[1]
    httpd.shutdown()


def _raw_post(live, body: bytes | dict, headers=None):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(live.url + "/chat/completions", data=data,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _user(*parts):
    return [{"role": "user", "content": list(parts)}]


BAD_INPUTS = {
    "unreachable_url": (400, "could not fetch", lambda d, port: _user(
        {"type": "image_url", "image_url": {"url": f"http://127.0.0.1:{port}/nothing.png"}}, _text())),
    "undecodable_video": (400, "messages[0].content[0].video_url.url: {d}/broken.mp4: ", lambda d, port: _user(
        {"type": "video_url", "video_url": {"url": str(d / "broken.mp4")}}, _text())),
    "text_file_as_video_over_http": (400, "messages[0].content[0].video_url.url: http://127.0.0.1:{port}/", lambda d, port: _user(
        {"type": "video_url", "video_url": {"url": f"http://127.0.0.1:{port}/notes.mp4"}}, _text())),
    "picture_as_video": (400, "messages[0].content[0].video_url.url: {d}/red.png is an image (PNG), not a video; "
                         "send it in an image_url part", lambda d, port: _user(
        {"type": "video_url", "video_url": {"url": str(d / "red.png")}}, _text())),
    "undecodable_video_data_uri": (400, "messages[0].content[0].video_url.url: ", lambda d, port: _user(
        {"type": "video_url", "video_url": {"url": "data:video/mp4;base64," + base64.b64encode(b"not a video").decode()}},
        _text())),
    "undecodable_image": (400, "messages[0].content[0]", lambda d, port: _user(
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(b"junk").decode()}},
        _text())),
    "too_many_frames": (400, "frames", lambda d, port: _user(
        {"type": "video_url", "video_url": {"url": str(d / "clip.mp4"), "max_frames": 500}}, _text())),
    "oversized_upload": (413, "larger than", lambda d, port: _user(
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 2_800_000}}, _text())),
    "local_path_outside_allow_list": (403, "outside the folders", lambda d, port: _user(
        {"type": "image_url", "image_url": {"url": "/etc/hostname"}}, _text())),
    "missing_local_file": (400, "does not exist", lambda d, port: _user(
        {"type": "image_url", "image_url": {"url": str(d / "nope.png")}}, _text())),
    "bad_base64": (400, "base64", lambda d, port: _user(
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@@"}}, _text())),
    "unknown_part_type": (400, "content[0].type", lambda d, port: _user({"type": "audio", "audio": "x"})),
    "empty_messages": (400, "messages", lambda d, port: []),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_gets_a_4xx_and_the_server_keeps_serving(case, live, client, media_dir, text_server):
    status, needle, build = BAD_INPUTS[case]
    port = text_server if case == "text_file_as_video_over_http" else free_port()
    code, body = _raw_post(live, {"model": "keye-tiny", "messages": build(media_dir, port), "max_tokens": 4})
    assert code == status, body
    message = body["error"]["message"]
    assert needle.format(d=media_dir, port=port) in message, body
    # the client's own name for its file, never the server's temporary copy nor the processor's item label
    assert "keye_serve_" not in message and "/tmp" not in message.replace(str(media_dir), "")
    assert "(row 0)" not in message and "item video" not in message and "item image" not in message
    ok = client.chat.completions.create(model="keye-tiny", messages=[{"role": "user", "content": "hi"}],
                                        max_tokens=2, temperature=0)
    assert ok.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("body, status, needle", [
    (b"{not json", 400, "not valid JSON"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10_000}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": -1}, 400, "temperature"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 9, "temperature": 0}, 400, "n"),
    ({"messages": [{"role": "user", "content": "hi"}], "model": "gpt-9"}, 404, "gpt-9"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, 400, "role"),
    ({"messages": [{"role": "user", "content": "hi"}], "stop": 3}, 400, "stop"),
    ({"messages": [{"role": "user", "content": "hi"}], "mode": "ponder"}, 400, "mode"),
])
def test_bad_request_fields(live, body, status, needle):
    code, resp = _raw_post(live, body)
    assert code == status, resp
    assert needle in resp["error"]["message"]
    assert resp["error"]["type"]


def test_openai_client_raises_on_4xx(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="keye-tiny", messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=100_000)
    assert "max_tokens" in str(info.value)


def test_thinking_mode_reaches_the_prompt(client, tiny):
    """mode / chat_template_kwargs select Keye's /think and /no_think suffixes (prompt lengths differ)."""
    plain = client.chat.completions.create(model="keye-tiny", messages=[{"role": "user", "content": "Why?"}],
                                           max_tokens=1, temperature=0)
    think = client.chat.completions.create(model="keye-tiny", messages=[{"role": "user", "content": "Why?"}],
                                           max_tokens=1, temperature=0, extra_body={"mode": "think"})
    no_think = client.chat.completions.create(
        model="keye-tiny", messages=[{"role": "user", "content": "Why?"}], max_tokens=1, temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    proc = tiny[1]
    for resp, mode in ((plain, None), (think, "think"), (no_think, "no_think")):
        n = proc([{"role": "user", "content": [_text("Why?")]}], mode=mode)["input_ids"].shape[1]
        assert resp.usage.prompt_tokens == n
    assert think.usage.prompt_tokens > plain.usage.prompt_tokens


def test_oversized_body_gets_413(live):
    big = json.dumps({"messages": [{"role": "user", "content": "x" * 4_100_000}]}).encode()
    code, body = _raw_post(live, big)
    assert code == 413 and "bytes" in body["error"]["message"]


def test_health_reports_engine_counts(live):
    with urllib.request.urlopen(live.url.removesuffix("/v1") + "/health", timeout=10) as resp:
        body = json.loads(resp.read())
    assert body["status"] == "ok" and body["engine"]["requests"] >= 0


def test_greedy_n_choices_are_n_copies_of_the_greedy_answer(client, live, tiny):
    """As OpenAI: n > 1 with temperature 0 is n identical greedy answers (decoded once)."""
    before = dict(live.server.engine.stats)
    r = client.chat.completions.create(model="keye-tiny", messages=[{"role": "user", "content": "Say hello."}],
                                       max_tokens=12, temperature=0, n=3)
    expected = _reference(tiny, [_text("Say hello.")], max_new_tokens=12)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.message.content for c in r.choices] == [expected] * 3
    assert live.server.engine.stats["rows"] - before["rows"] == 1
    one = client.chat.completions.create(model="keye-tiny", messages=[{"role": "user", "content": "Say hello."}],
                                         max_tokens=12, temperature=0)
    assert r.usage.completion_tokens == 3 * one.usage.completion_tokens
    chunks = list(client.chat.completions.create(model="keye-tiny", max_tokens=12, temperature=0, n=2, stream=True,
                                                 messages=[{"role": "user", "content": "Say hello."}]))
    texts = ["".join(ch.delta.content or "" for chunk in chunks for ch in chunk.choices if ch.index == i)
             for i in (0, 1)]
    assert texts == [expected] * 2


def test_usage_counts_the_tokens_keye_chat_and_the_demo_show(client, tiny):
    """One count everywhere (keye.demo.session.generated_tokens): the tokens generated, the end token
    included; the server's usage and the CLI / demo footer agree on the same greedy reply."""
    from keye.demo.session import ChatSession, SamplingSettings, reply_stats, stream_reply

    model, proc = tiny
    question = "hi"
    r = client.chat.completions.create(model="keye-tiny", messages=[{"role": "user", "content": question}],
                                       max_tokens=64, temperature=0)
    assert r.choices[0].finish_reason == "stop", r  # ended by the end token, which both must count
    batch = proc(ChatSession().messages(question), mode=None)
    gen = {"tokens": 0}
    text = "".join(stream_reply(model, proc, batch, SamplingSettings(max_new_tokens=64, greedy=True), gen))
    assert text == r.choices[0].message.content
    assert r.usage.completion_tokens == gen["tokens"]
    # ... which is every generated token up to and including the end token, as generate() returns them
    ids = model.generate(**batch, max_new_tokens=64, do_sample=False)[0, batch["input_ids"].shape[1]:].tolist()
    eos = set(model.config.eos_token_ids)
    assert gen["tokens"] == next(i + 1 for i, t in enumerate(ids) if t in eos)
    line = reply_stats(text, gen["tokens"], proc.tokenizer)["line"]
    assert line.endswith(f"· {gen['tokens']} token{'s' if gen['tokens'] != 1 else ''}"), line


@pytest.fixture(scope="module")
def synth_clip(media_dir):
    """An unseen synthetic clip (seed 909, which keye-tiny's build never draws) with a direction question."""
    from keye.data.synth import generate_split

    rows = [json.loads(line) for line in generate_split(media_dir / "synth", "test", 40, seed=909, workers=1,
                                                        progress=False).read_text().splitlines()]
    row = next(r for r in rows if r["question_type"] == "direction")
    mover = row["messages"][0]["content"][1]["text"].split("\n")[0].split("does the ")[1].split(" move")[0]
    return str(media_dir / "synth" / row["messages"][0]["content"][0]["video"]), mover, row


def test_think_mode_on_keye_tiny_fills_reasoning_content(client, synth_clip):
    """keye-tiny was trained with the switches: /think (or extra_body mode) returns its trace as
    reasoning_content and the answer as content; /no_think returns no reasoning."""
    video, mover, row = synth_clip
    content = [{"type": "video_url", "video_url": {"url": video}},
               {"type": "text", "text": f"Which way does the {mover} move?"}]
    think = client.chat.completions.create(model="keye-tiny", messages=[{"role": "user", "content": content}],
                                           max_tokens=64, temperature=0, extra_body={"mode": "think"})
    message = think.choices[0].message
    assert message.reasoning_content and message.reasoning_content.strip(), message
    assert message.content.strip() and "<think>" not in message.content, message  # right or wrong, an answer
    assert mover.split()[1] in message.reasoning_content  # the trace describes the clip's objects
    direct = client.chat.completions.create(
        model="keye-tiny", max_tokens=64, temperature=0,
        messages=[{"role": "user", "content": [content[0], {"type": "text", "text": content[1]["text"] + "/no_think"}]}])
    assert direct.choices[0].message.reasoning_content is None
    assert direct.choices[0].message.content.strip() in ("left", "right", "up", "down")
