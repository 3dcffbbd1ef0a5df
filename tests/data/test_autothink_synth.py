"""``keye data autothink``: the three-role pipeline against a deterministic fake OpenAI-compatible server
(labels, output schema, auto-format replies, retries, rate limit, resume after an interrupted run) and end to
end against a live ``keye serve`` on keye-tiny."""

from __future__ import annotations

import base64
import http.server
import json
import threading
import time
from pathlib import Path

import pytest

from keye.data.autothink import (
    DROPPED_NAME,
    FAILED_NAME,
    MANIFEST_NAME,
    AutoThinkDataConfig,
    EndpointConfig,
    default_config,
    synthesize,
)
from keye.data.manifest import read_manifest
from keye.data.records import PredictionStore
from keye.processing.chat import parse_response
from keye.rewards.format import check_format

N_QUESTIONS = 12
# Behaviour of question i by i % 4 (computed here, independently of the pipeline's labelling):
#   0: solver right, thinker right -> no_think;  1: only the thinker right -> think
#   2: neither -> unsolved (dropped);            3: solver right, thinker wrong -> no_think
EXPECTED = {0: "no_think", 1: "think", 2: "unsolved", 3: "no_think"}
ALWAYS_FAILS = "q07"  # every solver attempt gets a 503: the question fails, the run goes on


def _qid(i: int) -> str:
    return f"q{i:02d}"


def _answer(i: int) -> int:
    return 3 + i  # distinct per question, so a reply for the wrong question would be wrong


def _trace(i: int) -> str:
    return f"I count the objects of {_qid(i)} one by one: 1, 2, 3 and so on."


class FakeOpenAI:
    """A chat-completions server whose reply depends only on (role, question): the role is read from the
    prompt (``/no_think`` solver, ``/think`` thinker, the critic's system turn), the question from its
    ``[qNN]`` tag. Some first attempts fail (500, 429 with Retry-After, a reply slower than the client's
    timeout); every request is logged with its arrival time."""

    def __init__(self, image_bytes: bytes | None = None, faults: bool = True, malformed: tuple[str, ...] = ()):
        self.log: list[tuple[float, str, str]] = []  # (arrival time, role, question id)
        self.images_ok: list[bool] = []
        self.lock = threading.Lock()
        self.faults, self.malformed = faults, malformed
        self.image_bytes = image_bytes
        self.seen: dict[tuple[str, str], int] = {}
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's naming
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                status, payload, headers = fake.answer(body)
                data = json.dumps(payload).encode()
                try:
                    self.send_response(status)
                    for k, v in headers.items():
                        self.send_header(k, v)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:
                    pass  # the client timed out and closed the connection

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()

    def requests_for(self, qid: str, since: float = 0.0) -> list[str]:
        with self.lock:
            return [role for t, role, q in self.log if q == qid and t >= since]

    def answer(self, body: dict) -> tuple[int, dict, dict]:
        msgs = body["messages"]
        user = msgs[-1]["content"]
        text = user if isinstance(user, str) else " ".join(p["text"] for p in user if p["type"] == "text")
        if msgs[0]["role"] == "system":
            role = "critic"
        elif text.endswith("/no_think"):
            role = "solver"
        elif text.endswith("/think"):
            role = "thinker"
        else:
            return 400, {"error": {"message": f"no mode switch in {text!r}"}}, {}
        qid = text[text.index("[q") + 1 : text.index("[q") + 4]
        i = int(qid[1:])
        with self.lock:
            self.log.append((time.monotonic(), role, qid))
            attempt = self.seen.get((role, qid), 0)
            self.seen[(role, qid)] = attempt + 1
        if role != "critic" and self.image_bytes is not None:
            url = next(p["image_url"]["url"] for p in user if p["type"] == "image_url")
            ok = url.startswith("data:image/png;base64,") and base64.b64decode(url.split(",", 1)[1]) == self.image_bytes
            with self.lock:
                self.images_ok.append(ok)
        if self.faults:
            if qid == "q97":
                return 429, {"error": {"message": "rate limited"}}, {"Retry-After": "2"}
            if qid == "q98":
                return 500, {"error": {"message": "internal error"}}, {}
            if qid == ALWAYS_FAILS and role == "solver":
                return 503, {"error": {"message": "overloaded"}}, {}
            if attempt == 0 and (role, qid) == ("solver", "q01"):
                return 500, {"error": {"message": "internal error"}}, {}
            if attempt == 0 and (role, qid) == ("thinker", "q02"):
                return 429, {"error": {"message": "slow down"}}, {"Retry-After": "0"}
            if attempt == 0 and (role, qid) == ("solver", "q05"):
                time.sleep(1.5)  # longer than the client's timeout: the attempt times out and is retried
        right, wrong = str(_answer(i)), str(_answer(i) + 100)
        kind = i % 4
        reasoning = None
        if role == "solver":
            content = f"The answer is {right if kind in (0, 3) else wrong}."
            if qid in self.malformed:
                content += "</answer>"  # a stray closing tag: right, but not trainable as it is
        elif role == "thinker":
            final = right if kind in (0, 1) else wrong
            if i % 2 == 0:  # raw tags in the content (a server without a reasoning parser)
                content = f"<think>{_trace(i)}</think>The answer is {final}."
            else:  # split like vLLM's reasoning parser and keye serve
                content, reasoning = f"The answer is {final}.", _trace(i)
        else:
            direct_ok, think_ok = kind in (0, 3), kind in (0, 1)
            if qid == "q04":
                content = "I am not sure what you want."  # no JSON verdict
            else:
                if qid == "q06":
                    think_ok = not think_ok  # q06 = kind 2: the critic wrongly accepts the trace
                verdict = {"direct_correct": direct_ok, "think_correct": think_ok,
                           "analysis": f"Counting in {qid} is simple enough to do at a glance."}
                content = "```json\n" + json.dumps(verdict) + "\n```"
        message = {"role": "assistant", "content": content}
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        return 200, {"id": "x", "object": "chat.completion", "model": body["model"],
                     "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
                     "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}}, {}


def _png(path: Path) -> bytes:
    from PIL import Image

    Image.new("RGB", (8, 8), (200, 30, 30)).save(path)
    return path.read_bytes()


def _write_questions(folder: Path, n: int, *, bad_rows: bool = True) -> tuple[Path, bytes]:
    """A manifest of n numeric questions tagged [qNN], each with one image, plus two bad rows."""
    media = folder / "media"
    media.mkdir(parents=True)
    png = _png(media / "dot.png")
    lines = []
    for i in range(n):
        row = {"id": _qid(i), "messages": [
            {"role": "user", "content": [{"type": "image", "image": "media/dot.png"},
                                         {"type": "text", "text": f"[{_qid(i)}] How many objects are there?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": str(_answer(i))}]}],
            "answer": str(_answer(i)), "answer_kind": "numeric", "question_type": "count", "tolerance": 0,
            "meta": {"source": "test"}}
        lines.append(json.dumps(row))
    if bad_rows:
        lines.insert(3, '{"id": "broken", "messages": [')  # line 4: invalid JSON
        lines.append(json.dumps({"id": "noref", "messages": [{"role": "user", "content": "[q99] hi"}]}))
    path = folder / "questions.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path, png


def _config(url: str, **kw) -> AutoThinkDataConfig:
    cfg = default_config(url, "fake", progress=False, backoff=0.01, backoff_max=0.05, **kw)
    for role in ("solver", "thinker", "critic"):
        getattr(cfg, role).timeout = 0.5
    return cfg


def _ids(path: Path) -> list[str]:
    return [json.loads(line)["id"] for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("transport", ["openai", "httpx"])
def test_labels_schema_retries_against_a_fake_server(tmp_path, transport):
    manifest, png = _write_questions(tmp_path / "data", N_QUESTIONS)
    out = tmp_path / "out"
    with FakeOpenAI(png) as fake:
        summary = synthesize(manifest, out, _config(fake.url, concurrency=3, retries=2, transport=transport))

    want = {_qid(i): EXPECTED[i % 4] for i in range(N_QUESTIONS) if _qid(i) != ALWAYS_FAILS}
    # Counts: 11 questions done, 1 failed, 2 bad input rows (invalid JSON on line 4, no reference on line 14).
    assert (summary.questions, summary.done, summary.failed, summary.bad_input) == (N_QUESTIONS, 11, 1, 2)
    assert summary.labels == {lab: sum(v == lab for v in want.values()) for lab in ("no_think", "think", "unsolved")}
    # Retries: q01's 500, q02's 429, q05's timeout once each; q07 twice before giving up (retries=2).
    assert summary.retries == 5
    # Requests: 3 per done question + the 3 retried attempts among them + q07's 3 solver attempts.
    assert summary.requests == 11 * 3 + 3 + 3
    assert fake.images_ok and all(fake.images_ok)  # the image reached the endpoint as a data URL, intact
    # q04's critic reply has no verdict; q06's critic wrongly accepts the trace (the rule check decides).
    assert (summary.critic_unparsed, summary.critic_disagree, summary.critic_agree) == (1, 1, 9)

    man = read_manifest(out / MANIFEST_NAME)
    assert man.bad_rows == []
    assert {s.id: s.row["mode_label"] for s in man.samples} == {k: v for k, v in want.items() if v != "unsolved"}
    assert sorted(_ids(out / DROPPED_NAME)) == sorted(k for k, v in want.items() if v == "unsolved")
    for s in man.samples:
        i = int(s.id[1:])
        row = s.row
        assert row["answer"] == str(_answer(i)) and row["meta"] == {"source": "test"}  # input columns kept
        assert s.media[0].path == str((tmp_path / "data" / "media" / "dot.png").resolve())  # relative to out/
        user, reply = s.messages[-2], s.messages[-1]
        assert user["content"][-1]["text"] == f"[{s.id}] How many objects are there?"  # auto: no switch
        text = reply["content"][0]["text"]
        assert check_format(text, "auto") == (1.0, "")
        parsed = parse_response(text)
        assert parsed.answer == f"The answer is {_answer(i)}."
        if row["mode_label"] == "think":
            assert parsed.mode == "auto_think" and parsed.think == _trace(i)
        else:
            assert parsed.mode == "auto_no_think" and parsed.think is None
        assert row["solver"]["correct"] is (i % 4 in (0, 3))
        assert row["thinker"]["correct"] is (i % 4 in (0, 1)) and row["thinker"]["trace"] == _trace(i)
        critic = row["critic"]
        assert critic["decided_by"] == "rule" and critic["rule"]["label"] == row["mode_label"]
        if s.id == "q04":
            assert critic["llm"]["verdict"] is None and critic["analysis_source"] == "template"
            assert parsed.analysis.startswith("This count question")
        else:
            assert critic["llm"]["agrees"] is True and critic["analysis_source"] == "critic"
            assert parsed.analysis == f"Counting in {s.id} is simple enough to do at a glance."
        assert row["solver"]["attempts"] == (2 if s.id in ("q01", "q05") else 1)
    q06 = json.loads((out / DROPPED_NAME).read_text().splitlines()[_ids(out / DROPPED_NAME).index("q06")])
    assert q06["critic"]["llm"]["agrees"] is False and q06["critic"]["llm"]["verdict"]["label"] == "think"

    failed = [json.loads(x) for x in (out / FAILED_NAME).read_text().splitlines()]
    assert [(f["kind"], f["line"], f["id"]) for f in failed] == [
        ("bad_input", 4, None), ("bad_input", 14, "noref"), ("request_failed", 9, ALWAYS_FAILS)]
    assert "503" in failed[2]["reason"] and str(manifest) == failed[0]["file"]


def test_llm_decides_when_asked(tmp_path):
    manifest, png = _write_questions(tmp_path / "data", 8, bad_rows=False)
    with FakeOpenAI(png, faults=False) as fake:
        summary = synthesize(manifest, tmp_path / "out", _config(fake.url, decide_by="llm", unsolved="keep"))
    rows = {s.id: s.row for s in read_manifest(tmp_path / "out" / MANIFEST_NAME).samples}
    assert summary.done == 8 and len(rows) == 8  # unsolved kept as prompt-only rows
    # q06 (neither right): the LLM critic's wrong "think" verdict now decides; q04 falls back to the rule.
    assert rows["q06"]["mode_label"] == "think" and rows["q06"]["critic"]["decided_by"] == "llm"
    assert rows["q04"]["critic"]["decided_by"] == "rule_fallback" and rows["q04"]["mode_label"] == "no_think"
    assert rows["q02"]["mode_label"] == "unsolved" and rows["q02"]["messages"][-1]["role"] == "user"


def test_malformed_reply_is_dropped_not_retried(tmp_path):
    manifest, png = _write_questions(tmp_path / "data", 4, bad_rows=False)
    with FakeOpenAI(png, faults=False, malformed=("q00", "q01")) as fake:
        summary = synthesize(manifest, tmp_path / "out", _config(fake.url, critic_llm=False))
        rerun = synthesize(manifest, tmp_path / "out", _config(fake.url, critic_llm=False))
    # q00 (direct answer right but carrying a stray tag) is dropped with the reason; q01's direct answer is
    # wrong anyway, so its label is think and the thinker's reply is used.
    dropped = {json.loads(x)["id"]: json.loads(x) for x in (tmp_path / "out" / DROPPED_NAME).read_text().splitlines()}
    assert dropped["q00"]["drop_reason"].startswith("malformed reply") and dropped["q00"]["mode_label"] == "no_think"
    assert set(_ids(tmp_path / "out" / MANIFEST_NAME)) == {"q01", "q03"}
    assert (summary.done, summary.failed, rerun.skipped, rerun.done) == (4, 0, 4, 0)


def test_backoff_doubles_is_capped_and_honours_retry_after():
    import threading as _threading

    from keye.data.autothink import ChatClient, RateLimiter, TransientError

    with FakeOpenAI() as fake:
        for qid, backoff_max, want in (("q98", 10.0, [0.25, 0.5, 1.0]), ("q98", 0.6, [0.25, 0.5, 0.6]),
                                       ("q97", 10.0, [2.0, 2.0, 2.0]), ("q97", 1.5, [1.5, 1.5, 1.5])):
            delays: list[float] = []
            stats = {"requests": 0, "retries": 0}
            client = ChatClient(EndpointConfig(fake.url, "fake", timeout=5), RateLimiter(0), retries=3, backoff=0.25,
                                backoff_max=backoff_max, transport="httpx", stats=stats, lock=_threading.Lock(),
                                sleep=delays.append)
            with pytest.raises(TransientError, match="gave up after 4 attempts"):
                client.chat([{"role": "user", "content": f"[{qid}] hello/no_think"}])
            client.close()
            assert delays == want and stats == {"requests": 4, "retries": 3}


def test_rows_without_a_rule_check_need_the_llm_critic(tmp_path):
    from keye.data.autothink import load_questions

    path = tmp_path / "m.jsonl"
    rows = [{"id": "a", "messages": [{"role": "user", "content": "Describe it."}], "answer": "a red circle",
             "answer_kind": "text"},
            {"id": "b", "messages": [{"role": "user", "content": "How many?"}], "answer": "2", "answer_kind": "numeric"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    items, bad = load_questions(path, need_rule=True)
    assert [i["id"] for i in items] == ["b"] and [(b["line"], b["id"]) for b in bad] == [(1, "a")]
    assert "no rule check" in bad[0]["reason"]
    items, bad = load_questions(path, need_rule=False)
    assert [i["id"] for i in items] == ["a", "b"] and bad == []


def test_rate_limit_is_shared_by_the_workers(tmp_path):
    manifest, png = _write_questions(tmp_path / "data", 10, bad_rows=False)
    rps = 20.0
    with FakeOpenAI(png, faults=False) as fake:
        synthesize(manifest, tmp_path / "out", _config(fake.url, concurrency=4, rps=rps, critic_llm=False))
        times = sorted(t for t, _, _ in fake.log)
    assert len(times) == 20  # solver + thinker per question, no critic requests
    # 4 workers against an instant server would send hundreds per second; the limiter spaces all starts.
    assert times[-1] - times[0] >= (len(times) - 1) / rps * 0.9
    for k in range(len(times) - 4):  # no burst: any 5 consecutive requests span about 4 intervals
        assert times[k + 4] - times[k] >= 4 / rps * 0.4  # slack: a loaded machine may delay one arrival


def test_resume_after_an_interrupted_run(tmp_path):
    manifest, png = _write_questions(tmp_path / "data", N_QUESTIONS, bad_rows=False)
    out = tmp_path / "out"
    seen: list[str] = []

    def stop_after_five(rec):
        seen.append(rec["id"])
        if len(seen) == 5:
            raise KeyboardInterrupt

    with FakeOpenAI(png, faults=False) as fake:
        with pytest.raises(KeyboardInterrupt):
            synthesize(manifest, out, _config(fake.url, concurrency=2), on_record=stop_after_five)
        done = _ids(out / MANIFEST_NAME) + _ids(out / DROPPED_NAME)
        assert sorted(done) == sorted(seen)
        # A crash in the middle of a write leaves half a line behind.
        # The cut row is one the stopped run never asked about, so no late request of that run can count.
        cut = next(_qid(i) for i in range(N_QUESTIONS)
                   if not fake.requests_for(_qid(i)) and EXPECTED[i % 4] != "unsolved")
        with open(out / MANIFEST_NAME, "a") as f:
            f.write(json.dumps({"id": cut, "messages": []})[:-8])  # cut mid-row, no newline
        time.sleep(0.3)  # let the stopped run's in-flight requests finish before marking the rerun's start
        t_rerun = time.monotonic()
        summary = synthesize(manifest, out, _config(fake.url, concurrency=2))
        for qid in done:
            assert fake.requests_for(qid, since=t_rerun) == []  # done rows are not asked again
        assert sorted(fake.requests_for(cut, since=t_rerun)) == ["critic", "solver", "thinker"]
    assert summary.skipped == 5 and summary.done == N_QUESTIONS - 5
    all_ids = _ids(out / MANIFEST_NAME) + _ids(out / DROPPED_NAME)
    assert sorted(all_ids) == sorted(_qid(i) for i in range(N_QUESTIONS))  # each id exactly once
    assert read_manifest(out / MANIFEST_NAME).bad_rows == []
    assert len(PredictionStore(out / MANIFEST_NAME).load()) == summary.rows_total


def test_cli_per_role_endpoints_and_exit_code(tmp_path, capsys):
    import argparse

    from keye.data import cli

    manifest, png = _write_questions(tmp_path / "data", 4)  # with the two bad rows -> exit code 1
    parser = argparse.ArgumentParser(prog="keye")
    cli.add_commands(parser.add_subparsers())
    with FakeOpenAI(png, faults=False) as fake:
        args = parser.parse_args([
            "data", "autothink", str(manifest), "--out", str(tmp_path / "out"), "--base-url", "http://127.0.0.1:9/v1",
            "--model", "nobody", "--solver-url", fake.url, "--solver-model", "fake", "--thinker-url", fake.url,
            "--thinker-model", "fake", "--no-critic-llm", "--no-progress", "--retries", "0", "--rps", "50"])
        assert args.func(args) == 1
    assert {role for _, role, _ in fake.log} == {"solver", "thinker"}  # the critic default was never used
    printed = capsys.readouterr().out
    assert "questions 4: done 4" in printed and "bad input rows 2" in printed
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["labels"] == {
        "no_think": 2, "think": 1, "unsolved": 1}


def test_config_errors_name_the_field(tmp_path):
    from keye.errors import KeyeConfigError

    with pytest.raises(KeyeConfigError, match="thinker.base_url"):
        synthesize(tmp_path / "x.jsonl", tmp_path, AutoThinkDataConfig(
            solver=EndpointConfig("http://a/v1", "m"), thinker=EndpointConfig("a/v1", "m"),
            critic=EndpointConfig("http://a/v1", "m")))
    with pytest.raises(KeyeConfigError, match="decide_by"):
        default_config("http://a/v1", "m", decide_by="llm", critic_llm=False).validate()


# ------------------------------------------------------------------------------ live keye serve, keye-tiny


def test_end_to_end_against_keye_serve_on_keye_tiny(tmp_path):
    import keye
    from keye.data.synth import generate
    from keye.serve.app import BackgroundServer, KeyeServer, ServerConfig
    from keye.serve.engine import EngineConfig
    from keye.serve.media import MediaPolicy
    from keye.serve.protocol import ServerLimits

    paths = generate(tmp_path / "synth", train=3, test=0, seed=11, workers=0, image_fraction=0.34, progress=False)
    model, processor = keye.load_tiny()
    config = ServerConfig(
        model_name="keye-tiny", engine=EngineConfig(max_batch_size=4, batch_window_ms=20, max_queue=32),
        limits=ServerLimits(max_tokens=64, default_max_tokens=16, max_frames=8),
        media=MediaPolicy(max_bytes=4_000_000, timeout=5, allowed_dirs=[tmp_path / "synth"]),
    )
    with BackgroundServer(KeyeServer(model, processor, config)) as srv:
        cfg = default_config(srv.url, "keye-tiny", progress=False, unsolved="keep", media="path", concurrency=2)
        cfg.solver.max_tokens, cfg.thinker.max_tokens, cfg.critic.max_tokens = 16, 24, 24
        summary = synthesize(paths["train"], tmp_path / "out", cfg)
    assert (summary.done, summary.failed, summary.bad_input) == (3, 0, 0)
    man = read_manifest(tmp_path / "out" / MANIFEST_NAME)
    assert man.bad_rows == [] and len(man.samples) == 3
    first = read_manifest(paths["train"]).samples[0]
    row = next(s for s in man.samples if s.id == first.id)
    # The solver's reply is what keye-tiny answers directly to the same clip and question (greedy).
    media = dict(first.messages[0]["content"][0])
    if media["type"] == "video":
        media["max_frames"] = 8  # what the server adds for a video_url without its own
    batch = processor([{"role": "user", "content": [media, first.messages[0]["content"][1]]}], mode="no_think")
    ids = model.generate(**batch, max_new_tokens=16, do_sample=False)
    expected = processor.decode(ids[0, batch["input_ids"].shape[1]:], skip_special_tokens=True)
    assert parse_response(row.row["solver"]["content"]).answer == parse_response(expected).answer
    for s in man.samples:
        assert s.row["mode_label"] in ("no_think", "think", "unsolved")
        if s.row["mode_label"] != "unsolved":
            assert check_format(s.messages[-1]["content"][0]["text"], "auto")[0] == 1.0
