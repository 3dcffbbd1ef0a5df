"""``keye data autothink``: mode-labelled SFT data from three roles over OpenAI-compatible endpoints.

KAT-V1 builds its dual-regime data with an agentic framework of *solver*, *thinker* and *critic* roles
(training.md §3); Keye-VL's auto-think cold-start data is "analysis + think + answer" for complex prompts and
"analysis + direct answer" for simple ones (training.md §2.3). This module does that for any keye manifest
of questions with references (e.g. ``keye data synth``'s ``train.jsonl``):

1. **solver**: the question with ``/no_think`` appended (Keye's switch, also Qwen3's): a direct answer.
2. **thinker**: the question with ``/think``: a reasoning trace and an answer.
3. **critic**: a *rule check* scores both answers against the reference with the synthetic set's scorer
   (:func:`keye.data.synth_answers.extract` + :func:`keye.data.synth_answers.is_correct`: deterministic, no
   model), and, unless switched off, an *LLM critic* call on the critic endpoint judges both too and writes
   the row's analysis sentence. Its verdict is always recorded; which one decides is ``decide_by``:

   - ``"rule"`` (default): the rule check decides; the LLM verdict is recorded with ``agrees``. Rules do
     not hallucinate, and keye-tiny-sized critics would.
   - ``"llm"``: the parsed LLM verdict decides; the rule check is the fallback when the critic's reply does not
     parse. Rows whose ``answer_kind`` has no rule scorer (anything but ``mc`` / ``numeric``) are always
     decided by the LLM critic, and are bad input when it is switched off.

   The label: ``"no_think"`` when the direct answer is right (the cheaper mode suffices, even if the trace is
   right too), ``"think"`` when only the thinker's answer is right (and it wrote a non-empty trace), otherwise
   ``"unsolved"``: dropped by default (``unsolved="drop"``, the row goes to ``dropped.jsonl``) or kept as a
   prompt-only row with ``mode_label: "unsolved"`` (``unsolved="keep"``: hard prompts for RL).

Output folder (``out``):

- ``autothink.jsonl``: the SFT manifest (:mod:`keye.data.manifest` schema). Every input field is kept
  (``answer``, ``question_type``, ``meta``, ...); the prompt loses any ``/think`` switch (auto mode) and the
  input's assistant turn is replaced by Keye's auto-format reply: ``<analysis>why</analysis>`` then either
  ``<think>trace</think>answer`` (label think) or the direct answer (label no_think). Media paths are
  rewritten relative to ``out`` so the manifest reads from its own folder. Extra columns: ``mode_label``,
  ``solver`` / ``thinker`` (the role's raw ``content`` and ``reasoning``, the parsed ``answer``, ``trace``,
  ``prediction``, ``correct``, ``finish_reason``, ``usage``, ``attempts``), ``critic`` (``rule`` and ``llm``
  verdicts, ``decided_by``, ``analysis_source``).
- ``dropped.jsonl``: questions decided but not written to the manifest (same columns, ``drop_reason``).
- ``failed.jsonl``: this run's failures (requests that failed after the retries, bad input rows with their
  file and line, replies that cannot be assembled); rewritten by each run, and failed questions are asked
  again by the next one.
- ``summary.json``: the counts of :class:`Summary`.

Resume: the two output files are append-only JSONL, one line written (and fsynced) as each question
completes; a rerun skips every id already in ``autothink.jsonl`` or ``dropped.jsonl`` and sends none of its
requests again. A last line cut short by a crash is detected and removed
(:class:`keye.data.records.PredictionStore`).

Robustness: every HTTP attempt passes one client-side rate limiter shared by all worker threads (``rps``:
request starts per second, 0 = unlimited); connection errors, timeouts, HTTP 408 / 409 / 429 and 5xx are
retried up to ``retries`` times with exponential backoff (``backoff * 2**attempt`` seconds, capped at
``backoff_max``; a server's ``Retry-After`` is honoured within the cap); other 4xx fail the question at once.
"""

from __future__ import annotations

import base64
import json
import mimetypes
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from keye.errors import KeyeConfigError, KeyeError, KeyeInputError

ROLES = ("solver", "thinker", "critic")
LABELS = ("no_think", "think", "unsolved")
RULE_KINDS = ("mc", "numeric")  # answer kinds the synthetic set's scorer handles
MANIFEST_NAME = "autothink.jsonl"
DROPPED_NAME = "dropped.jsonl"
FAILED_NAME = "failed.jsonl"
SUMMARY_NAME = "summary.json"
_RETRY_STATUS = (408, 409, 429)  # plus every 5xx
_VIDEO_OPTIONS = ("fps", "max_frames", "nframes", "video_start", "video_end")  # keye serve's video_url keys
_TAG = re.compile(r"</?\s*(?:analysis|think|answer)\b", re.IGNORECASE)


# ------------------------------------------------------------------------------------------------ config


@dataclass
class EndpointConfig:
    """One role's OpenAI-compatible endpoint.

    Attributes:
        base_url: the API root, e.g. ``http://127.0.0.1:8000/v1`` (``keye serve``, vLLM) or a hosted API.
        model: the ``model`` field of each request.
        api_key_env: name of the environment variable holding the API key (the key itself never enters a
            config or an output file); unset variable -> ``"EMPTY"`` (local servers do not check it).
        temperature: sampling temperature (0 = greedy).
        max_tokens: generation budget per reply.
        suffix: text appended to the last user text (Keye's / Qwen3's mode switch); solver ``/no_think``,
            thinker ``/think``, critic none.
        timeout: seconds for one HTTP attempt.
        extra_body: extra JSON fields merged into every request (e.g. vLLM's ``chat_template_kwargs``).
    """

    base_url: str
    model: str
    api_key_env: str = "OPENAI_API_KEY"
    temperature: float = 0.0
    max_tokens: int = 512
    suffix: str = ""
    timeout: float = 120.0
    extra_body: dict[str, Any] = field(default_factory=dict)

    def validate(self, role: str) -> None:
        """Raise :class:`KeyeConfigError` naming ``role`` and the field for an unusable endpoint."""
        if not self.base_url or not self.base_url.startswith(("http://", "https://")):
            raise KeyeConfigError(f"{role}.base_url must be an http(s) URL, got {self.base_url!r}")
        if not self.model:
            raise KeyeConfigError(f"{role}.model is empty (the model name the endpoint serves)")
        if self.max_tokens < 1 or self.timeout <= 0 or not 0.0 <= self.temperature <= 2.0:
            raise KeyeConfigError(
                f"{role}: need max_tokens >= 1, timeout > 0 and 0 <= temperature <= 2, got "
                f"{self.max_tokens}, {self.timeout}, {self.temperature}"
            )

    def api_key(self) -> str:
        """The key read from ``api_key_env`` (``"EMPTY"`` when the variable is unset)."""
        return os.environ.get(self.api_key_env, "") or "EMPTY"


@dataclass
class AutoThinkDataConfig:
    """Everything :func:`synthesize` needs besides the input and output paths.

    Attributes:
        solver / thinker / critic: the three endpoints (may all be the same server and model).
        critic_llm: call the critic endpoint (False: the rule check alone; no critic requests).
        decide_by: ``"rule"`` or ``"llm"`` (module docstring).
        unsolved: ``"drop"`` or ``"keep"`` (module docstring).
        media: how images / videos travel: ``"data"`` (base64 ``data:`` URLs, works with any endpoint) or
            ``"path"`` (``file://`` URLs: the server must read the files, e.g. ``keye serve
            --allow-local-media DIR`` or vLLM's ``--allowed-local-media-path``; no base64 overhead).
        concurrency: worker threads (questions in flight).
        rps: request starts per second across all workers (0 = no limit).
        retries: extra attempts per request after a transient failure.
        backoff / backoff_max: exponential backoff base and cap, seconds.
        limit: process at most this many input questions (in file order, done ones included), None = all.
        resume: skip ids already written; False starts over (the output files are emptied).
        critic_trace_chars: the thinker's trace is cut to its last this many characters in the critic prompt.
        transport: ``"openai"`` (the ``openai`` client; default when installed) or ``"httpx"``.
        progress: show a tqdm bar.
    """

    solver: EndpointConfig
    thinker: EndpointConfig
    critic: EndpointConfig
    critic_llm: bool = True
    decide_by: str = "rule"
    unsolved: str = "drop"
    media: str = "data"
    concurrency: int = 4
    rps: float = 0.0
    retries: int = 5
    backoff: float = 0.5
    backoff_max: float = 30.0
    limit: int | None = None
    resume: bool = True
    critic_trace_chars: int = 4000
    transport: str | None = None
    progress: bool = True

    def validate(self) -> None:
        """Raise :class:`KeyeConfigError` naming the field for any invalid setting."""
        for role in ROLES:
            if role != "critic" or self.critic_llm:
                getattr(self, role).validate(role)
        choices = {"decide_by": ("rule", "llm"), "unsolved": ("drop", "keep"), "media": ("data", "path"),
                   "transport": (None, "openai", "httpx")}
        for key, allowed in choices.items():
            if getattr(self, key) not in allowed:
                raise KeyeConfigError(f"{key} must be one of {allowed}, got {getattr(self, key)!r}")
        if self.decide_by == "llm" and not self.critic_llm:
            raise KeyeConfigError("decide_by='llm' needs the LLM critic (critic_llm=True)")
        if self.concurrency < 1 or self.rps < 0 or self.retries < 0 or self.backoff < 0 or self.backoff_max < 0:
            raise KeyeConfigError(
                f"need concurrency >= 1 and rps, retries, backoff, backoff_max >= 0; got {self.concurrency}, "
                f"{self.rps}, {self.retries}, {self.backoff}, {self.backoff_max}"
            )
        if self.limit is not None and self.limit < 0:
            raise KeyeConfigError(f"limit must be >= 0, got {self.limit}")


def default_config(base_url: str, model: str, **overrides: Any) -> AutoThinkDataConfig:
    """A config with one endpoint for all three roles (the role defaults: solver ``/no_think`` 512 tokens,
    thinker ``/think`` 2048 tokens, critic no switch 512 tokens, all greedy); ``overrides`` set top-level
    fields of :class:`AutoThinkDataConfig`."""
    return AutoThinkDataConfig(
        solver=EndpointConfig(base_url, model, suffix="/no_think", max_tokens=512),
        thinker=EndpointConfig(base_url, model, suffix="/think", max_tokens=2048),
        critic=EndpointConfig(base_url, model, suffix="", max_tokens=512),
        **overrides,
    )


# ------------------------------------------------------------------------------------- rate limit, retries


class RateLimiter:
    """Spaces request starts at least ``1 / rps`` seconds apart across every thread that shares it.

    Each :meth:`acquire` reserves the next free start time under a lock and sleeps until it outside the lock,
    so N workers together never exceed ``rps`` (no bursts). ``rps <= 0`` disables the limit.
    """

    def __init__(self, rps: float, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep):
        self.interval = 1.0 / rps if rps > 0 else 0.0
        self._clock, self._sleep = clock, sleep
        self._next = 0.0
        self._lock = threading.Lock()

    def acquire(self) -> None:
        """Block until this caller may start a request."""
        if self.interval == 0.0:
            return
        with self._lock:
            now = self._clock()
            start = max(now, self._next)
            self._next = start + self.interval
        if start > now:
            self._sleep(start - now)


class TransientError(KeyeError):
    """A request failure worth retrying (connection error, timeout, 408/409/429/5xx); ``retry_after`` is the
    server's ``Retry-After`` in seconds, if it sent one."""

    def __init__(self, message: str, status: int | None = None, retry_after: float | None = None):
        super().__init__(message)
        self.status, self.retry_after = status, retry_after


class RequestError(KeyeError):
    """A request failure that retrying will not fix (4xx other than 408/409/429, a malformed reply)."""


@dataclass
class Reply:
    """One role's reply: the message ``content``, the server-split ``reasoning`` (vLLM's / keye serve's
    ``reasoning_content``, None when absent), ``finish_reason``, token ``usage``, and ``attempts`` made."""

    content: str
    reasoning: str | None
    finish_reason: str | None
    usage: dict[str, int] | None
    attempts: int = 1


def _retry_after(headers: Any) -> float | None:
    try:
        value = headers.get("retry-after") if headers is not None else None
        return None if value is None else max(0.0, float(value))
    except (TypeError, ValueError):
        return None  # an HTTP-date Retry-After: fall back to our own backoff


def _status_error(status: int, text: str, headers: Any) -> KeyeError:
    msg = f"HTTP {status}: {text[:300]}"
    if status in _RETRY_STATUS or status >= 500:
        return TransientError(msg, status, _retry_after(headers))
    return RequestError(msg)


def _reply_from_body(body: Mapping[str, Any]) -> Reply:
    try:
        choice = body["choices"][0]
        msg = choice["message"]
    except (KeyError, IndexError, TypeError):
        raise RequestError(f"reply has no choices[0].message: {str(body)[:300]}") from None
    reasoning = msg.get("reasoning_content") or msg.get("reasoning")
    usage = body.get("usage") or None
    if usage is not None:
        usage = {k: int(usage[k]) for k in ("prompt_tokens", "completion_tokens") if usage.get(k) is not None}
    return Reply(msg.get("content") or "", reasoning or None, choice.get("finish_reason"), usage)


class ChatClient:
    """Chat completions on one endpoint with the shared rate limiter, retries and backoff.

    ``transport`` ``"openai"`` uses the ``openai`` client (its own retries off: every attempt must pass the rate
    limiter and be counted); ``"httpx"`` posts the same JSON with ``httpx``. ``stats`` (a dict guarded by
    ``lock``) counts ``requests`` (attempts) and ``retries``.
    """

    def __init__(
        self,
        endpoint: EndpointConfig,
        limiter: RateLimiter,
        *,
        retries: int,
        backoff: float,
        backoff_max: float,
        transport: str,
        stats: dict[str, int],
        lock: threading.Lock,
        sleep: Callable[[float], None] = time.sleep,
    ):
        self.endpoint, self.limiter = endpoint, limiter
        self.retries, self.backoff, self.backoff_max = retries, backoff, backoff_max
        self.stats, self.lock, self._sleep = stats, lock, sleep
        self.transport = transport
        if transport == "openai":
            from openai import OpenAI

            self._client: Any = OpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key(), max_retries=0,
                                       timeout=endpoint.timeout)
        else:
            import httpx

            self._client = httpx.Client(timeout=endpoint.timeout,
                                        headers={"Authorization": f"Bearer {endpoint.api_key()}"})

    def close(self) -> None:
        """Close the underlying HTTP connections."""
        self._client.close()

    def _once(self, messages: list[dict[str, Any]]) -> Reply:
        ep = self.endpoint
        if self.transport == "openai":
            import openai

            try:
                resp = self._client.chat.completions.create(
                    model=ep.model, messages=messages, temperature=ep.temperature, max_tokens=ep.max_tokens,
                    extra_body=ep.extra_body or None,
                )
            except openai.APIStatusError as err:
                raise _status_error(err.status_code, str(err), err.response.headers) from None
            except openai.APIConnectionError as err:  # includes APITimeoutError
                raise TransientError(f"{type(err).__name__}: {err}") from None
            return _reply_from_body(resp.model_dump())
        import httpx

        body = {"model": ep.model, "messages": messages, "temperature": ep.temperature,
                "max_tokens": ep.max_tokens, **ep.extra_body}
        try:
            r = self._client.post(ep.base_url.rstrip("/") + "/chat/completions", json=body)
        except httpx.TransportError as err:  # connect errors, timeouts, dropped connections
            raise TransientError(f"{type(err).__name__}: {err}") from None
        if r.status_code != 200:
            raise _status_error(r.status_code, r.text, r.headers)
        try:
            return _reply_from_body(r.json())
        except ValueError:
            raise RequestError(f"reply is not JSON: {r.text[:300]}") from None

    def chat(self, messages: list[dict[str, Any]]) -> Reply:
        """Send one chat request (OpenAI message format); return the first choice.

        Raises:
            TransientError: still failing after ``retries`` retries.
            RequestError: a non-retryable failure.
        """
        for attempt in range(self.retries + 1):
            self.limiter.acquire()
            with self.lock:
                self.stats["requests"] += 1
            try:
                reply = self._once(messages)
            except TransientError as err:
                if attempt == self.retries:
                    raise TransientError(f"gave up after {attempt + 1} attempts: {err}", err.status) from None
                delay = min(self.backoff_max, self.backoff * 2**attempt)
                if err.retry_after is not None:
                    delay = min(self.backoff_max, max(delay, err.retry_after))
                with self.lock:
                    self.stats["retries"] += 1
                self._sleep(delay)
                continue
            reply.attempts = attempt + 1
            return reply
        raise AssertionError("unreachable")  # the loop returns or raises


# ----------------------------------------------------------------------------------------- requests


def _media_url(path: str, kind: str, media: str, cache: dict[str, str]) -> str:
    """The URL a media item travels as: URLs unchanged, local files as ``data:`` or ``file://`` URLs."""
    if path.startswith(("http://", "https://", "data:")):
        return path
    if media == "path":
        return Path(path).resolve().as_uri()
    if path not in cache:
        mime = mimetypes.guess_type(path)[0] or ("image/png" if kind == "image" else "video/mp4")
        try:
            data = Path(path).read_bytes()
        except OSError as err:
            raise KeyeInputError(f"cannot read {kind} ({err.strerror})", path=path) from None
        cache[path] = f"data:{mime};base64," + base64.b64encode(data).decode("ascii")
    return cache[path]


def to_openai_messages(messages: list[dict[str, Any]], media: str = "data",
                       cache: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Convert keye messages (parsed manifest form, absolute media paths) to OpenAI chat messages.

    Text items become ``text`` parts, images ``image_url`` parts and videos ``video_url`` parts carrying
    keye's video options (``fps``, ``max_frames``, ... next to ``url``, as ``keye serve`` reads them);
    ``media`` picks ``data:`` or ``file://`` URLs for local files. Raises :class:`KeyeInputError` for a
    frame-list video (the OpenAI format has no frame lists) or an unreadable file.
    """
    cache = {} if cache is None else cache
    out = []
    for msg in messages:
        content = msg["content"]
        if isinstance(content, str):
            out.append({"role": msg["role"], "content": content})
            continue
        parts: list[dict[str, Any]] = []
        for item in content:
            kind = item.get("type")
            if kind == "text":
                parts.append({"type": "text", "text": item["text"]})
            elif kind == "image":
                url = _media_url(item["image"], "image", media, cache)
                parts.append({"type": "image_url", "image_url": {"url": url}})
            elif kind == "video":
                if isinstance(item["video"], list):
                    raise KeyeInputError("frame-list videos cannot be sent in the OpenAI chat format; "
                                         "encode the frames as a video file")
                ref = {"url": _media_url(item["video"], "video", media, cache)}
                ref.update({k: item[k] for k in _VIDEO_OPTIONS if k in item})
                parts.append({"type": "video_url", "video_url": ref})
            else:
                raise KeyeInputError(f"unsupported content item type {kind!r}")
        out.append({"role": msg["role"], "content": parts})
    return out


def with_suffix(messages: list[dict[str, Any]], suffix: str) -> list[dict[str, Any]]:
    """Return ``messages`` with any ``/think`` / ``/no_think`` switch removed from the last user text and
    ``suffix`` appended there (:func:`keye.processing.chat.apply_mode` for the two switches)."""
    from keye.processing.chat import apply_mode, edit_last_user_text
    from keye.rewards.format import split_mode_switch

    plain = apply_mode(messages, "auto")
    if not suffix:
        return plain
    rest, mode = split_mode_switch(suffix)
    if mode is not None and not rest.strip():
        return apply_mode(plain, mode)
    # Any other suffix (a different model family's switch) is appended the same way as text.
    return edit_last_user_text(plain, lambda text: text + suffix)


def question_text(messages: list[dict[str, Any]]) -> str:
    """The text of the last user turn (media left out): what the critic is told the question was."""
    from keye.processing.chat import apply_mode

    user = [m for m in apply_mode(messages, "auto") if m["role"] == "user"][-1]
    content = user["content"]
    if isinstance(content, str):
        return content.strip()
    return " ".join(c["text"] for c in content if c.get("type") == "text").strip()


CRITIC_SYSTEM = (
    "You are the critic of a data pipeline that teaches a model when to think step by step. You get a "
    "question, its reference answer, a direct answer given without reasoning and an answer given after "
    "reasoning. Judge each answer against the reference only (the meaning must match; wording may differ). "
    "Reply with one JSON object and nothing else."
)


def critic_messages(item: Mapping[str, Any], direct: str, trace: str, think_answer: str,
                    trace_chars: int = 4000) -> list[dict[str, Any]]:
    """The LLM critic's request (text only; the critic compares answers, it need not see the media)."""
    lines = [f"Question: {question_text(item['messages'])}"]
    choices = item.get("choices")
    if choices:
        lines.append("Options: " + "; ".join(f"{chr(65 + i)}. {c}" for i, c in enumerate(choices)))
    ref = str(item["answer"])
    if choices and len(ref) == 1 and "A" <= ref <= chr(64 + len(choices)):
        ref = f"{ref} ({choices[ord(ref) - 65]})"
    if item.get("tolerance"):
        ref += f" (numbers within {item['tolerance']} count as correct)"
    lines.append(f"Reference answer: {ref}")
    lines.append(f"Direct answer: {direct or '(empty)'}")
    trace = trace[-trace_chars:] if trace_chars > 0 else trace
    lines.append(f"Reasoning: {trace or '(none)'}")
    lines.append(f"Answer after reasoning: {think_answer or '(empty)'}")
    lines.append(
        'Reply as {"direct_correct": true or false, "think_correct": true or false, "analysis": "one sentence '
        "written as the answering model's own judgement, before answering, of whether this question needs "
        'step-by-step reasoning; do not mention the reference or the answers"}'
    )
    return [{"role": "system", "content": CRITIC_SYSTEM}, {"role": "user", "content": "\n".join(lines)}]


def parse_verdict(text: str) -> dict[str, Any] | None:
    """Read the critic's JSON verdict from ``text``: ``{"direct_correct": bool, "think_correct": bool,
    "analysis": str | None, "label": ...}`` with ``label`` derived from the two flags as the rule check
    derives it; None when no JSON object with both booleans is found (after any think block)."""
    from keye.processing.chat import parse_response

    body = parse_response(text).answer or text
    for candidate in (body, text):
        for m in re.finditer(r"\{.*?\}", candidate, re.DOTALL):
            try:
                obj = json.loads(m.group(0))
            except ValueError:
                continue
            if isinstance(obj, dict) and isinstance(obj.get("direct_correct"), bool) and isinstance(
                obj.get("think_correct"), bool
            ):
                analysis = obj.get("analysis")
                analysis = analysis.strip() if isinstance(analysis, str) and analysis.strip() else None
                return {"direct_correct": obj["direct_correct"], "think_correct": obj["think_correct"],
                        "analysis": analysis,
                        "label": label_for(obj["direct_correct"], obj["think_correct"])}
    return None


def label_for(direct_correct: bool, think_correct: bool) -> str:
    """The mode label: direct right -> ``"no_think"`` (cheaper), else thinker right -> ``"think"``, else
    ``"unsolved"``."""
    if direct_correct:
        return "no_think"
    return "think" if think_correct else "unsolved"


# -------------------------------------------------------------------------------------- assembling rows


def analysis_for(label: str, question_type: str | None) -> str:
    """The template analysis sentence of a label (used when the LLM critic gives none)."""
    what = f"This {question_type.replace('_', ' ')} question" if question_type else "This question"
    if label == "think":
        return f"{what} needs step-by-step work before the answer, so I will reason it through first."
    return f"{what} can be answered directly from what is shown; no step-by-step reasoning is needed."


def auto_reply(label: str, analysis: str, answer: str, trace: str | None = None) -> str:
    """Keye's auto-mode reply: ``<analysis>A</analysis><think>T</think>answer`` (think) or
    ``<analysis>A</analysis>answer`` (no_think). Raises :class:`KeyeInputError` when the parts would not give a
    well-formed reply (:func:`keye.rewards.format.check_format` in auto mode)."""
    from keye.rewards.format import check_format

    if label not in ("think", "no_think"):
        raise KeyeInputError(f"no auto reply for label {label!r}")
    for name, part in (("analysis", analysis), ("answer", answer), ("trace", trace or "")):
        if _TAG.search(part):
            raise KeyeInputError(f"the {name} contains a reasoning tag and would break the reply format")
    text = f"<analysis>{analysis.strip()}</analysis>"
    if label == "think":
        text += f"<think>{(trace or '').strip()}</think>"
    text += answer.strip()
    score, reason = check_format(text, "auto")
    if score != 1.0:
        raise KeyeInputError(f"the assembled auto reply is malformed: {reason}")
    return text


def _role_record(reply: Reply, item: Mapping[str, Any], rule: bool) -> dict[str, Any]:
    """What one answering role said and whether the rule check accepts it."""
    from keye.data.synth_answers import extract, is_correct
    from keye.processing.chat import parse_response

    parsed = parse_response(reply.content)
    trace = reply.reasoning if reply.reasoning is not None else parsed.think
    if reply.reasoning is not None and parsed.think:
        trace = parsed.think  # the server left the tags in: the think block is the trace
    answer = parsed.answer
    prediction = extract(answer, item) if rule else None
    return {
        "content": reply.content,
        "reasoning": reply.reasoning,
        "answer": answer,
        "trace": (trace or "").strip(),
        "prediction": prediction,
        "correct": is_correct(prediction, item) if rule else None,
        "finish_reason": reply.finish_reason,
        "usage": reply.usage,
        "attempts": reply.attempts,
    }


def _relocate(messages: list[dict[str, Any]], out_dir: Path) -> list[dict[str, Any]]:
    """Messages with local media paths made relative to ``out_dir`` (so the output manifest is portable with
    its data folder); URLs and data URIs unchanged."""
    out = []
    for msg in messages:
        if isinstance(msg["content"], str):
            out.append(dict(msg))
            continue
        items = []
        for item in msg["content"]:
            item = dict(item)
            kind = item.get("type")
            if kind in ("image", "video"):
                value = item[kind]
                paths = value if isinstance(value, list) else [value]
                moved = []
                for p in paths:
                    if p.startswith(("http://", "https://", "data:")):
                        moved.append(p)
                        continue
                    try:
                        moved.append(os.path.relpath(p, out_dir))
                    except ValueError:  # another drive on Windows: keep the absolute path
                        moved.append(p)
                item[kind] = moved if isinstance(value, list) else moved[0]
            items.append(item)
        out.append({"role": msg["role"], "content": items})
    return out


# ------------------------------------------------------------------------------------------- the run


@dataclass
class Summary:
    """Counts of one :func:`synthesize` run.

    ``questions``: valid input questions considered (after ``limit``); ``skipped``: already done before this
    run; ``done``: completed in this run (written to the manifest or to ``dropped.jsonl``); ``written`` /
    ``dropped``: how they split; ``failed``: questions that failed in this run (in ``failed.jsonl``);
    ``bad_input``: malformed input rows; ``labels``: this run's label counts; ``critic_agree`` /
    ``critic_disagree`` / ``critic_unparsed``: the LLM critic against the rule check; ``requests`` /
    ``retries``: HTTP attempts and retried attempts; ``rows_total``: rows in the output manifest after the
    run; ``seconds``: wall time; ``interrupted``: the run was stopped (Ctrl-C) before the end.
    """

    questions: int = 0
    skipped: int = 0
    done: int = 0
    written: int = 0
    dropped: int = 0
    failed: int = 0
    bad_input: int = 0
    labels: dict[str, int] = field(default_factory=lambda: dict.fromkeys(LABELS, 0))
    critic_agree: int = 0
    critic_disagree: int = 0
    critic_unparsed: int = 0
    requests: int = 0
    retries: int = 0
    rows_total: int = 0
    seconds: float = 0.0
    interrupted: bool = False

    def format(self) -> str:
        """One human-readable paragraph."""
        labels = ", ".join(f"{k} {v}" for k, v in self.labels.items())
        return (
            f"questions {self.questions}: done {self.done} (written {self.written}, dropped {self.dropped}), "
            f"skipped {self.skipped} (already done), failed {self.failed}, bad input rows {self.bad_input}\n"
            f"labels: {labels}\n"
            f"LLM critic vs rule: agree {self.critic_agree}, disagree {self.critic_disagree}, "
            f"unparsed {self.critic_unparsed}\n"
            f"requests {self.requests} ({self.retries} retries) in {self.seconds:.1f} s; "
            f"manifest rows now {self.rows_total}" + ("; INTERRUPTED" if self.interrupted else "")
        )


class _Pipeline:
    """One question at a time through the three roles (called from the worker threads)."""

    def __init__(self, config: AutoThinkDataConfig, out_dir: Path, stats: dict[str, int], lock: threading.Lock):
        transport = config.transport
        if transport is None:
            try:
                import openai  # noqa: F401

                transport = "openai"
            except ImportError:
                transport = "httpx"
        self.config, self.out_dir = config, out_dir
        limiter = RateLimiter(config.rps)
        common = dict(retries=config.retries, backoff=config.backoff, backoff_max=config.backoff_max,
                      transport=transport, stats=stats, lock=lock)
        self.clients = {r: ChatClient(getattr(config, r), limiter, **common) for r in ROLES
                        if r != "critic" or config.critic_llm}

    def close(self) -> None:
        for c in self.clients.values():
            c.close()

    def run(self, item: dict[str, Any]) -> dict[str, Any]:
        """Return the output record of one question (``mode_label`` set; ``drop_reason`` when it is not a
        manifest row). Raises TransientError / RequestError / KeyeInputError on failure."""
        cfg = self.config
        rule = item["answer_kind"] in RULE_KINDS
        cache: dict[str, str] = {}
        replies = {}
        for role in ("solver", "thinker"):
            prompt = with_suffix(item["messages"], getattr(cfg, role).suffix)
            msgs = to_openai_messages(prompt, cfg.media, cache)
            replies[role] = _role_record(self.clients[role].chat(msgs), item, rule)
        solver, thinker = replies["solver"], replies["thinker"]
        thinker_ok = None if not rule else bool(thinker["correct"] and thinker["trace"])
        rule_verdict = None
        if rule:
            rule_verdict = {"direct_correct": bool(solver["correct"]), "think_correct": thinker_ok,
                            "label": label_for(bool(solver["correct"]), bool(thinker_ok))}
        llm = None
        if cfg.critic_llm:
            msgs = critic_messages(item, solver["answer"], thinker["trace"], thinker["answer"],
                                   cfg.critic_trace_chars)
            reply = self.clients["critic"].chat(msgs)
            verdict = parse_verdict(reply.content)
            agrees = None
            if verdict is not None and rule_verdict is not None:
                agrees = verdict["label"] == rule_verdict["label"]
            llm = {"content": reply.content, "verdict": verdict, "agrees": agrees, "attempts": reply.attempts,
                   "usage": reply.usage}
        if cfg.decide_by == "llm" or not rule:
            if llm is not None and llm["verdict"] is not None:
                verdict, decided_by = llm["verdict"], "llm"
            elif rule_verdict is not None:
                verdict, decided_by = rule_verdict, "rule_fallback"
            else:
                raise RequestError("the critic's reply has no parsable verdict and this answer_kind has no rule "
                                   f"check: {(llm or {}).get('content', '')[:200]!r}")
        else:
            verdict, decided_by = rule_verdict, "rule"
        label = verdict["label"]
        if label == "think" and not thinker["trace"]:
            label = "unsolved"  # an LLM critic may accept an answer that came without any reasoning to train on
        critic = {"rule": rule_verdict, "llm": llm, "decided_by": decided_by, "analysis_source": None}
        row = {k: v for k, v in item["row"].items() if k not in ("messages", "answers")}
        prompt = _relocate(with_suffix(item["messages"], ""), self.out_dir)  # auto mode: no switch
        row.update(id=item["id"], messages=prompt, mode_label=label, solver=solver, thinker=thinker,
                   critic=critic)
        if label == "unsolved":
            if cfg.unsolved == "drop":
                row["drop_reason"] = "unsolved"
            return row
        # The critic's analysis sentence is tried first, only when its own verdict is the label (otherwise it
        # argues for the other mode); the template sentence is the fallback when it is missing or would break
        # the reply's format (a tag, or naming the other mode's switch).
        llm_verdict = llm["verdict"] if llm is not None else None
        candidates = []
        if llm_verdict is not None and llm_verdict["label"] == label and llm_verdict["analysis"]:
            candidates.append((llm_verdict["analysis"], "critic"))
        candidates.append((analysis_for(label, item.get("question_type")), "template"))
        text = error = None
        for analysis, source in candidates:
            try:
                if label == "think":
                    text = auto_reply("think", analysis, thinker["answer"], thinker["trace"])
                else:
                    text = auto_reply("no_think", analysis, solver["answer"])
            except KeyeInputError as err:
                error = err
                continue
            critic["analysis_source"] = source
            break
        if text is None:
            # The answer or trace itself breaks the format (stray tags); asking again (same prompt, usually
            # greedy) would give the same reply, so the question counts as done and is dropped with the reason.
            row["drop_reason"] = f"malformed reply: {error}"
            return row
        row["messages"] = prompt + [{"role": "assistant", "content": [{"type": "text", "text": text}]}]
        return row


def _drop_final_assistant(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = list(messages)
    while out and out[-1]["role"] == "assistant":
        out.pop()
    return out


def load_questions(
    path: str | os.PathLike[str], *, need_rule: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Read a manifest into questions and bad rows.

    Returns ``(items, bad)``: each item has ``id``, ``line``, ``messages`` (parsed, absolute media paths, any
    final assistant turn removed), ``answer``, ``answer_kind``, ``question_type``, ``choices``, ``tolerance``
    and ``row`` (the raw JSON object); each bad row is ``{"kind": "bad_input", "file", "line", "id", "reason"}``
    (schema errors, duplicate ids, a missing ``answer`` / ``answer_kind``, and with ``need_rule`` an
    ``answer_kind`` the rule check cannot score). Raises :class:`KeyeInputError` when the file cannot be read.
    """
    from keye.data.manifest import read_manifest

    man = read_manifest(path)
    file = str(man.path)
    bad = [{"kind": "bad_input", "file": file, "line": b.line, "id": b.id, "reason": b.reason}
           for b in man.bad_rows]
    items = []
    for s in man.samples:
        row = s.row
        reason = None
        if "answer" not in row or "answer_kind" not in row:
            reason = "missing 'answer' or 'answer_kind' (the critic needs a reference)"
        elif need_rule and row["answer_kind"] not in RULE_KINDS:
            reason = (f"answer_kind {row['answer_kind']!r} has no rule check (only {', '.join(RULE_KINDS)}); "
                      "enable the LLM critic to label it")
        messages = _drop_final_assistant(s.messages)
        if reason is None and not any(m["role"] == "user" for m in messages):
            reason = "no user turn to ask"
        if reason is not None:
            bad.append({"kind": "bad_input", "file": file, "line": s.line, "id": s.id, "reason": reason})
            continue
        items.append({"id": s.id, "line": s.line, "messages": messages, "answer": str(row["answer"]),
                      "answer_kind": row["answer_kind"], "question_type": row.get("question_type"),
                      "choices": row.get("choices"), "tolerance": row.get("tolerance"), "row": row})
    bad.sort(key=lambda b: b["line"])
    return items, bad


def synthesize(
    manifest: str | os.PathLike[str],
    out: str | os.PathLike[str],
    config: AutoThinkDataConfig,
    *,
    on_record: Callable[[dict[str, Any]], None] | None = None,
) -> Summary:
    """Run the three roles over every question of ``manifest`` and write the output folder ``out`` (module
    docstring). Resumable: already written ids are skipped and not requested again.

    Args:
        on_record: called in the main thread after each record (a manifest or dropped row, or a failure
            ``{"kind": ...}``) is written; an exception it raises stops the run like Ctrl-C (the tests use it
            to interrupt a run).

    Returns:
        The :class:`Summary` (also written to ``out/summary.json``). A KeyboardInterrupt stops the run after
        writing what has completed and is re-raised after the summary is written.

    Raises:
        KeyeConfigError: an invalid config. KeyeInputError: the manifest cannot be read.
    """
    from tqdm import tqdm

    from keye.data.records import PredictionStore

    config.validate()
    t0 = time.perf_counter()
    items, bad = load_questions(manifest, need_rule=not config.critic_llm)  # before touching the output
    out_dir = Path(out).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    rows_store = PredictionStore(out_dir / MANIFEST_NAME)
    dropped_store = PredictionStore(out_dir / DROPPED_NAME)
    failed_path = out_dir / FAILED_NAME
    if not config.resume:
        for p in (rows_store.path, dropped_store.path):
            p.write_bytes(b"")
    done_ids = set(rows_store.load()) | set(dropped_store.load())  # load() also cuts a crash's partial line
    failed_path.write_bytes(b"")  # failures of this run only: failed questions are asked again

    if config.limit is not None:
        items = items[: config.limit]
    summary = Summary(questions=len(items), bad_input=len(bad))
    failed_store = PredictionStore(failed_path)
    for b in bad:
        print(f"bad input: {b['file']}:{b['line']}" + (f" ({b['id']})" if b["id"] else "") + f": {b['reason']}",
              file=sys.stderr)
    if bad:
        failed_store.append(bad)
    todo = [it for it in items if it["id"] not in done_ids]
    summary.skipped = len(items) - len(todo)

    stats, lock = {"requests": 0, "retries": 0}, threading.Lock()
    pipeline = _Pipeline(config, out_dir, stats, lock)
    bar = tqdm(total=len(items), initial=summary.skipped, desc="autothink", unit="q",
               disable=not config.progress)
    pool = ThreadPoolExecutor(max_workers=config.concurrency, thread_name_prefix="autothink")
    pending: dict[Future, dict[str, Any]] = {}
    queue = iter(todo)
    interrupt: BaseException | None = None
    try:
        # A bounded window of futures: a stopped run leaves few requests in flight, and memory stays flat.
        window = 2 * config.concurrency
        while True:
            while len(pending) < window:
                it = next(queue, None)
                if it is None:
                    break
                pending[pool.submit(pipeline.run, it)] = it
            if not pending:
                break
            finished, _ = wait(pending, return_when=FIRST_COMPLETED)
            for fut in finished:
                it = pending.pop(fut)
                try:
                    rec = fut.result()
                except Exception as err:  # noqa: BLE001 - one question's failure must not stop the run
                    if isinstance(err, (TransientError, RequestError)):
                        kind = "request_failed"
                    elif isinstance(err, KeyeInputError):
                        kind = "bad_input"  # unreadable media, a frame-list video, an unassemblable reply
                    else:
                        kind = "error"
                    rec = {"kind": kind, "file": str(manifest), "line": it["line"], "id": it["id"],
                           "reason": f"{type(err).__name__}: {err}"}
                    failed_store.append([rec])
                    summary.failed += 1
                else:
                    summary.done += 1
                    summary.labels[rec["mode_label"]] += 1
                    llm = rec["critic"]["llm"]
                    if llm is not None:
                        if llm["verdict"] is None:
                            summary.critic_unparsed += 1
                        elif llm["agrees"] is not None:
                            summary.critic_agree += int(llm["agrees"])
                            summary.critic_disagree += int(not llm["agrees"])
                    if "drop_reason" in rec:
                        dropped_store.append([rec])
                        summary.dropped += 1
                    else:
                        rows_store.append([rec])
                        summary.written += 1
                bar.update(1)
                bar.set_postfix(failed=summary.failed, **{k: v for k, v in summary.labels.items()})
                if on_record is not None:
                    on_record(rec)
    except (KeyboardInterrupt, Exception) as err:  # noqa: BLE001 - stop cleanly, keep what is written
        interrupt = err
        summary.interrupted = True
    finally:
        pool.shutdown(wait=interrupt is None, cancel_futures=True)
        bar.close()
        if interrupt is None:
            pipeline.close()
    summary.requests, summary.retries = stats["requests"], stats["retries"]
    summary.rows_total = len(rows_store.load(repair=False))
    summary.seconds = time.perf_counter() - t0
    (out_dir / SUMMARY_NAME).write_text(json.dumps(asdict(summary), indent=2) + "\n", encoding="utf-8")
    if interrupt is not None:
        raise interrupt
    return summary
