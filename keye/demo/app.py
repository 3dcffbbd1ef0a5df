"""The Gradio video Q&A demo: upload a video or images (or pick an example), ask, watch the answer stream.

The page shows, next to the chat, every frame the model saw (at the resolution it saw it, with its
timestamp, slow/fast type and token cost) and the token totals. Thinking goes into a collapsible block
above the answer; under a finished answer a small line says which mode the model chose and how many tokens
it spent. The model loads on a background thread; the status bar says when it is ready and
questions asked earlier wait for it. Requests are queued (one generation at a time by default) and any
bad upload is answered with a readable message in the page, the server carrying on.
"""

from __future__ import annotations

import atexit
import errno
import hashlib
import io
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gradio as gr

from keye.demo.engine import ModelHost, quiet_transformers
from keye.demo.examples import load_examples
from keye.demo.frames import seen_frames, token_summary
from keye.demo.session import MODES, ChatSession, SamplingSettings, VideoSettings, split_partial, stream_reply
from keye.errors import KeyeConfigError, KeyeError

log = logging.getLogger("keye.demo")

TITLE = "Keye-VL · video Q&A"
LOAD_WAIT_S = 900.0  # how long a question waits for a model that is still loading

CSS = """
.keye-header h1 {margin-bottom: 0.1em}
.keye-header p {margin-top: 0}
.keye-status {font-size: 0.92em; opacity: 0.9}
.keye-alert {border-left: 4px solid #d9534f; background: rgba(217, 83, 79, 0.08); padding: 0.4em 0.8em;
             border-radius: 4px}
.keye-summary {font-size: 0.92em}
/* Gradio cuts a gallery caption at 80% of the thumbnail with an ellipsis ("0.0 s · slow · 24 ..."): let the
   frame captions use the thumbnail's width and wrap instead. */
.keye-gallery .caption-label {max-width: calc(100% - 8px) !important; white-space: normal !important;
                              text-overflow: clip !important; overflow: visible !important}
footer {display: none !important}
/* Gradio lays a translucent "Loading..." sheet over the whole page until every component's code has loaded
   (about 1.5 s), while the page already shows: a click on an example then hit the sheet and was lost. */
.gradio-container > .main > .wrap.translucent {pointer-events: none}
"""


def _theme() -> Any:
    return gr.themes.Soft(primary_hue="indigo", secondary_hue="slate")


def _files_list(files: Any) -> list[str]:
    if not files:
        return []
    if isinstance(files, (str, os.PathLike)):
        return [str(files)]
    return [str(getattr(f, "name", f)) for f in files]


def _summary_markdown(summary: dict[str, Any], gen: dict[str, Any] | None = None) -> str:
    lines = [
        f"**Prompt:** {summary['prompt_tokens']:,} tokens, of which **{summary['visual_tokens']:,} visual**"
    ]
    if summary["slow_frames"] or summary["fast_frames"]:
        slow_hw, fast_hw = summary["slow_size"], summary["fast_size"]
        part = f"**Frames:** {summary['slow_frames']} slow"
        if slow_hw:
            part += f" at {slow_hw[1]}×{slow_hw[0]} ({summary['slow_tokens']:,} tokens)"
        part += f", {summary['fast_frames']} fast"
        if fast_hw:
            part += f" at {fast_hw[1]}×{fast_hw[0]} ({summary['fast_tokens']:,} tokens)"
        lines.append(part)
    if summary["images"]:
        lines.append(f"**Images:** {summary['images']} ({summary['image_tokens']:,} tokens)")
    if gen is not None and gen.get("tokens"):
        rate = gen["tokens"] / gen["seconds"] if gen["seconds"] > 0 else 0.0
        lines.append(
            f"**Generated:** {gen['tokens']} tokens in {gen['seconds']:.1f} s ({rate:.1f} tokens/s; "
            f"prompt + first token {gen['first']:.1f} s)"
        )
    return "  \n".join(lines)


# A line that is nothing but a list marker or a heading mark ("2.", "3)", "-", "#"): Markdown renders it as an
# empty list item or heading, so a one-word answer like "2." would show as a bare bullet.
_BARE_MARKER = re.compile(r"^(?P<indent>[ \t]*)(?P<marker>\d{1,9}[.)]|[-+*]|#{1,6})[ \t]*$", re.MULTILINE)


def markdown_safe(text: str) -> str:
    """``text`` for a Markdown view (the chat bubbles): a line holding only a list or heading marker gets its
    marker escaped (``2.`` -> ``2\\.``), so it shows as typed instead of as an empty list item or heading.
    Everything else, real lists included, is left to Markdown."""

    def escape(m: re.Match) -> str:
        marker = m["marker"]
        if marker[0].isdigit():
            return f"{m['indent']}{marker[:-1]}\\{marker[-1]}"
        return f"{m['indent']}\\{marker}"

    return _BARE_MARKER.sub(escape, text)


def _turn_messages(
    question: str, text: str, final: bool, stats: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    """Chatbot messages of one turn: the question, a collapsible thinking block if any, the answer.

    ``stats`` (a finished reply's :func:`keye.demo.session.reply_stats`) adds the token count to the
    thinking block's title and a small line under the answer with the mode the model chose and the tokens
    it spent ("mode: direct · 7 tokens").
    """
    view = split_partial(text)
    out: list[dict[str, Any]] = [{"role": "user", "content": markdown_safe(question)}]
    if view.thinking is not None:
        status = "done" if (view.thinking_done or final) else "pending"
        title = "Thinking"
        if stats is not None and stats.get("thought") and stats.get("think_tokens") is not None:
            title += f" · {stats['think_tokens']} tokens"
        out.append(
            {
                "role": "assistant",
                "content": markdown_safe(view.thinking) or "…",
                "metadata": {"title": title, "status": status},
            }
        )
    if view.answer or final:
        answer = markdown_safe(view.answer) or "*(no answer)*"
        if stats is not None:
            answer += f"\n\n<sub>{stats['line']}</sub>"
        out.append({"role": "assistant", "content": answer})
    elif view.thinking is None:
        out.append({"role": "assistant", "content": "…"})
    return out


def _alert(message: str) -> Any:
    """The message box: shown with ``message``, hidden when it is empty."""
    return gr.Markdown(value=message, visible=bool(message))


def skip_all(n: int) -> tuple:
    """``n`` "leave this output unchanged" updates."""
    return tuple(gr.skip() for _ in range(n))


def _new_state() -> dict[str, Any]:
    return {"key": None, "session": ChatSession(), "display": []}


def frame_files(frames: list, directory: str | os.PathLike) -> list[tuple[str, str]]:
    """The gallery entries ``(png path, caption)`` for ``frames``, each picture written once under ``directory``.

    Files are named by the hash of their PNG bytes and appear atomically (written aside, then renamed), and an
    existing file is never rewritten. Why files and not the PIL images: Gradio writes a returned PIL image
    into its cache at a path fixed by its content, truncating and rewriting it every time the image is
    returned, so returning the gallery twice (the first update and the final one) could truncate a picture
    while a client was still downloading it; a file path is copied into the cache once and then reused.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    out = []
    for f in frames:
        buf = io.BytesIO()
        f.image.save(buf, format="PNG")
        data = buf.getvalue()
        path = directory / f"{hashlib.sha256(data).hexdigest()[:32]}.png"
        if not path.exists():
            fd, staging = tempfile.mkstemp(dir=directory, prefix=".frame-", suffix=".png")
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
            os.replace(staging, path)
        out.append((str(path), f.caption()))
    return out


def effective_mode(question: str, radio: str | None) -> str | None:
    """The thinking mode a question runs in: a ``/think`` or ``/no_think`` typed at the end of the question wins
    (the radio's default, auto, would otherwise strip it), else the radio's mode (None for anything else)."""
    from keye.rewards.format import split_mode_switch

    return split_mode_switch(question)[1] or (radio if radio in MODES else None)


def make_respond(host: ModelHost, max_video_seconds: float | None, frame_dir: str | os.PathLike | None = None):
    """The chat handler bound to ``host``: a generator yielding ``(chatbot, state, alert, gallery, summary,
    question)`` updates while the answer streams. The gallery's pictures are written under ``frame_dir``
    (default: a fresh folder in the system temp directory, which Gradio serves from)."""
    if frame_dir is None:
        frame_dir = tempfile.mkdtemp(prefix="keye-demo-frames-")
        atexit.register(shutil.rmtree, frame_dir, True)
    frame_dir = Path(frame_dir)

    def respond(
        files: Any,
        question: str,
        state: dict[str, Any] | None,
        fps: float,
        max_frames: float,
        token_budget: float,
        slow_fast: bool,
        similarity: float,
        mode: str,
        greedy: bool,
        temperature: float,
        top_p: float,
        top_k: float,
        max_new_tokens: float,
        repetition_penalty: float,
    ) -> Iterator[tuple]:
        state = state or _new_state()
        skip = gr.skip()
        question = (question or "").strip()

        def fail(message: str) -> tuple:
            # The question stays in the box so the user can retry after fixing the upload or settings.
            return (state["display"], state, _alert(message), skip, skip, question)

        if not question:
            yield fail("Type a question first.")
            return
        t_wait = time.perf_counter()
        while not host.wait(0.5):
            if host.state == "failed":
                yield fail(f"The model could not be loaded: {host.error}")
                return
            if time.perf_counter() - t_wait > LOAD_WAIT_S:
                yield fail("The model is still loading; try again in a moment.")
                return
            yield (
                state["display"],
                state,
                _alert("The model is still loading… your question will run once it is ready."),
                skip,
                skip,
                question,
            )
        try:
            paths = _files_list(files)
            key = tuple(paths)
            if key != state["key"]:
                # New media, new conversation: earlier turns were about other pictures.
                state = {
                    "key": key,
                    "session": ChatSession.for_files(paths, max_video_seconds),
                    "display": [],
                }
            video = VideoSettings(fps=float(fps), max_frames=int(max_frames), token_budget=int(token_budget),
                                  slow_fast=bool(slow_fast), min_frame_similarity=float(similarity))
            sampling = SamplingSettings(max_new_tokens=int(max_new_tokens), greedy=bool(greedy),
                                        temperature=float(temperature), top_p=float(top_p), top_k=int(top_k),
                                        repetition_penalty=float(repetition_penalty))
            sampling.kwargs()
            session: ChatSession = state["session"]
            batch = host.processor(session.messages(question, video), mode=effective_mode(question, mode))
            frames = seen_frames(batch, host.processor)
            summary = token_summary(batch, frames)
            gallery = frame_files(frames, frame_dir)
            display = state["display"]
            yield (
                display + _turn_messages(question, "", False),
                state,
                _alert(""),
                gallery,
                _summary_markdown(summary),
                "",
            )
            text, stats = "", {"tokens": 0}
            t0 = time.perf_counter()
            first = None
            for piece in stream_reply(host.model, host.processor, batch, sampling, stats):
                first = first if first is not None else time.perf_counter() - t0
                text += piece
                yield (display + _turn_messages(question, text, False), state, skip, skip, skip, skip)
            gen = {"tokens": stats["tokens"], "seconds": time.perf_counter() - t0, "first": first or 0.0}
            _, reply = session.finish_turn(question, text, host.processor, stats["tokens"])
            state["display"] = display + _turn_messages(question, text, True, reply)
            yield (state["display"], state, _alert(""), gallery, _summary_markdown(summary, gen), "")
        except KeyeError as err:
            yield fail(f"**Cannot answer:** {err}")
        except Exception as err:  # the page must get a message and the server must keep serving
            log.exception("demo request failed")
            yield fail(f"**Internal error:** {err.__class__.__name__}: {err}")

    return respond


@dataclass
class _Controls:
    """The settings column's inputs, in the order :func:`make_respond`'s handler takes them."""

    fps: Any
    max_frames: Any
    budget: Any
    slow_fast: Any
    similarity: Any
    mode: Any
    greedy: Any
    temperature: Any
    top_p: Any
    top_k: Any
    max_new: Any
    repetition: Any

    def inputs(self) -> list[Any]:
        """The controls in handler order (video sampling, then generation)."""
        return [*self.video(), self.mode, self.greedy, self.temperature, self.top_p, self.top_k, self.max_new,
                self.repetition]

    def video(self) -> list[Any]:
        """The video sampling sliders, which follow the checkpoint's defaults once it is loaded."""
        return [self.fps, self.max_frames, self.budget, self.slow_fast, self.similarity]


def _settings_controls(video: VideoSettings, sampling: SamplingSettings) -> _Controls:
    """The "Video sampling" and "Generation" accordions, starting at ``video`` / ``sampling``."""
    with gr.Accordion("Video sampling", open=True):
        fps = gr.Slider(0.5, 8.0, value=video.fps, step=0.5, label="Frames per second")
        max_frames = gr.Slider(2, 256, value=video.max_frames, step=1, label="Max frames")
        budget = gr.Slider(256, 65536, value=video.token_budget, step=256, label="Visual token budget")
        slow_fast = gr.Checkbox(value=video.slow_fast is not False, label="Slow-fast encoding (Keye-VL 1.5)")
        similarity = gr.Slider(0.5, 1.0, value=video.min_frame_similarity, step=0.01,
                               label="Slow-frame similarity threshold")
    with gr.Accordion("Generation", open=False):
        mode = gr.Radio(list(MODES), value="auto", label="Thinking mode")
        greedy = gr.Checkbox(value=True, label="Greedy decoding (ignore the sampling settings)")
        with gr.Row():
            temperature = gr.Slider(0.05, 2.0, value=sampling.temperature, step=0.05, label="Temperature")
            top_p = gr.Slider(0.05, 1.0, value=sampling.top_p, step=0.05, label="Top-p")
        with gr.Row():
            top_k = gr.Slider(0, 200, value=sampling.top_k, step=1, label="Top-k (0 = off)")
            repetition = gr.Slider(1.0, 2.0, value=1.0, step=0.05, label="Repetition penalty")
        max_new = gr.Slider(1, 4096, value=sampling.max_new_tokens, step=1, label="Max new tokens")
    return _Controls(fps, max_frames, budget, slow_fast, similarity, mode, greedy, temperature, top_p, top_k,
                     max_new, repetition)


@dataclass
class _ChatView:
    """The chat column: the conversation, the question row and what the model saw."""

    chatbot: Any
    alert: Any
    question: Any
    send: Any
    clear: Any
    gallery: Any
    summary: Any


def _chat_view() -> _ChatView:
    """Build the chat column's components (inside the current Gradio layout block)."""
    chatbot = gr.Chatbot(label="Conversation", height=380, buttons=["copy"])
    alert = gr.Markdown("", label="Message", show_label=False, elem_classes="keye-alert", visible=False)
    with gr.Row():
        question = gr.Textbox(placeholder="Ask about the video… e.g. Which way does the red circle move? "
                                          "(end with /think to see its reasoning)",
                              label="Question", show_label=False, scale=5, lines=1, max_lines=6,
                              autofocus=True)
        send = gr.Button("Ask", variant="primary", scale=1, min_width=80)
        clear = gr.Button("New chat", scale=1, min_width=80)
    gallery = gr.Gallery(label="What the model saw (timestamp · slow/fast · tokens)", columns=4, height=340,
                         object_fit="contain", allow_preview=True, elem_classes="keye-gallery")
    summary = gr.Markdown("", label="Token counts", show_label=False, elem_classes="keye-summary")
    return _ChatView(chatbot, alert, question, send, clear, gallery, summary)


def _wire_deep_links(app: Any, examples: list[dict], files: Any, question: Any, respond: Any,
                     inputs: list[Any], outputs: list[Any]) -> None:
    """Deep links: ``?example=N`` fills in bundled example N, ``&ask=1`` also asks its question right away
    (shareable links, and how the README screenshot is taken by a headless browser).

    The page-load event only reads the URL into a State; the files and the question are filled by that
    State's change, which happens only when the URL holds a link. A load event with the files and the
    question among its outputs would cover both with its progress overlay, and make them its pending outputs,
    for its whole queued run after every page load, while the user may already be clicking an example.
    """
    link = gr.State(None)
    autorun = gr.State(False)

    def from_url(request: gr.Request) -> Any:
        params = dict(request.query_params) if request is not None else {}
        try:
            n = int(params.get("example", ""))
        except ValueError:
            return gr.skip()
        if not 0 <= n < len(examples or []):
            return gr.skip()
        return {"example": n, "ask": params.get("ask", "0").lower() in ("1", "true", "yes")}

    def fill(target: dict[str, Any] | None) -> tuple:
        if not target:
            return skip_all(3)
        row = examples[target["example"]]
        return [row["video"]], row["question"], target["ask"]

    def respond_if_asked(*args: Any) -> Iterator[tuple]:
        if not args[-1]:
            yield skip_all(len(outputs))
            return
        yield from respond(*args[:-1])

    app.load(from_url, None, [link], api_name=False, show_progress="hidden")
    link.change(fill, [link], [files, question, autorun], api_name=False).then(
        respond_if_asked, [*inputs, autorun], outputs, api_name=False
    )


def _wire_loading(app: Any, host: ModelHost, status: Any, controls: _Controls) -> None:
    """While the model loads, a timer refreshes the status line; once it is ready the video sliders take
    the checkpoint's own defaults and the timer stops."""
    timer = gr.Timer(1.0, active=host.state in ("idle", "loading"))

    def poll() -> tuple:
        loading = host.state in ("idle", "loading")
        if host.state != "ready":
            return (host.describe(), gr.Timer(active=loading), *skip_all(5))
        # Runs once per page when it first sees the model ready (the timer stops here).
        d = VideoSettings.for_checkpoint(host.processor)
        return (host.describe(), gr.Timer(active=False), d.fps, d.max_frames, d.token_budget,
                d.slow_fast is not False, d.min_frame_similarity)

    polled = [status, timer, *controls.video()]
    timer.tick(poll, None, polled, api_name=False, show_progress="hidden")
    app.load(poll, None, polled, api_name=False, show_progress="hidden")


def build_app(host: ModelHost, max_video_seconds: float | None = 600.0, examples: list[dict] | None = None):
    """Build the Gradio Blocks page around ``host`` (which may still be loading).

    ``examples`` rows ``{"video", "question"}`` (default: :func:`keye.demo.examples.load_examples`).
    The chat endpoint is exposed to API clients as ``/respond``.
    """
    if examples is None:
        examples = load_examples()
    # The checkpoint's own sampling defaults once it is loaded (the sliders follow when loading ends).
    settings_defaults = (
        VideoSettings.for_checkpoint(host.processor) if host.state == "ready" else VideoSettings()
    )
    with gr.Blocks(title=TITLE, analytics_enabled=False) as app:
        state = gr.State(_new_state())
        gr.Markdown(
            f"# {TITLE}\nAsk a Keye-VL model about a video or a few images. Below the chat: every frame it "
            "sampled, as the model saw it, with its timestamp, slow/fast type and token cost.",
            elem_classes="keye-header",
        )
        status = gr.Markdown(host.describe(), elem_classes="keye-status")
        with gr.Row(equal_height=False):
            with gr.Column(scale=2, min_width=320):
                files = gr.File(label="Video or images", file_count="multiple", type="filepath", height=120,
                                elem_id="keye-files")
                # Placeholder for the examples table, filled below once the question box exists.
                examples_slot = gr.Column()
                controls = _settings_controls(settings_defaults, SamplingSettings(greedy=True))
            with gr.Column(scale=3, min_width=420):
                view = _chat_view()
        if examples:
            with examples_slot:
                gr.Examples(examples=[[[e["video"]], e["question"]] for e in examples],
                            inputs=[files, view.question], label="Examples (held-out synthetic clips)",
                            cache_examples=False, elem_id="keye-examples")

        inputs = [files, view.question, state, *controls.inputs()]
        outputs = [view.chatbot, state, view.alert, view.gallery, view.summary, view.question]
        respond = make_respond(host, max_video_seconds)
        view.send.click(respond, inputs, outputs, api_name="respond")
        view.question.submit(respond, inputs, outputs, api_name=False)

        def reset() -> tuple:
            return [], _new_state(), _alert(""), None, ""

        cleared = [view.chatbot, state, view.alert, view.gallery, view.summary]
        view.clear.click(reset, None, cleared, api_name="reset")
        # User actions only (not .change): a deep link fills the files while its question is already running.
        for event in (files.upload, files.clear, files.delete):
            event(reset, None, cleared, api_name=False)
        _wire_deep_links(app, examples, files, view.question, respond, inputs, outputs)
        _wire_loading(app, host, status, controls)
    return app


def page_figures(host: ModelHost, example: dict[str, Any]) -> dict[str, Any]:
    """What the page shows after asking bundled ``example`` (a :func:`keye.demo.examples.load_examples` row)
    with the page's initial settings, by running the page's own handler (:func:`make_respond`) on the ready
    ``host``: the README screenshot's figures (``demo/make_screenshot.py`` writes them beside the PNG and
    ``tests/demo/test_readme_screenshot.py`` recomputes them).

    Returns ``{"model", "example", "question", "answer", "reply_line", "prompt_tokens", "visual_tokens",
    "generated_tokens", "frames"}``: the status line's model description without the load time, the example's
    file name and question, the answer bubble's text and the line under it, the summary's token counts and
    the gallery's captions. Timings are left out (they change from run to run).
    """
    if not host.wait(0):
        raise KeyeConfigError(f"the model is not loaded ({host.state}): {host.error or 'wait for it first'}")
    video = VideoSettings.for_checkpoint(host.processor)  # the sliders once the model is ready
    sampling = SamplingSettings(greedy=True)  # the Generation accordion's initial values
    with tempfile.TemporaryDirectory(prefix="keye-demo-figures-") as frames_dir:
        respond = make_respond(host, None, frame_dir=frames_dir)
        updates = list(respond([example["video"]], example["question"], None, video.fps, video.max_frames,
                               video.token_budget, video.slow_fast is not False, video.min_frame_similarity, "auto",
                               sampling.greedy, sampling.temperature, sampling.top_p, sampling.top_k,
                               sampling.max_new_tokens, sampling.repetition_penalty))
    chat, _, alert, gallery, summary, _ = updates[-1]
    if getattr(alert, "visible", False) or not chat:
        raise KeyeConfigError(f"the demo could not answer example {example['video']}: {getattr(alert, 'value', '')}")
    answer, _, line = chat[-1]["content"].partition("\n\n<sub>")
    counts = re.search(r"\*\*Prompt:\*\* ([\d,]+) tokens, of which \*\*([\d,]+) visual", summary)
    generated = re.search(r"\*\*Generated:\*\* (\d+) tokens?", summary)
    return {
        "model": host.describe().split(" · loaded in ")[0].replace("**", "").replace("`", ""),
        "example": Path(example["video"]).name,
        "question": example["question"],
        "answer": answer,
        "reply_line": line.removesuffix("</sub>"),
        "prompt_tokens": int(counts.group(1).replace(",", "")),
        "visual_tokens": int(counts.group(2).replace(",", "")),
        "generated_tokens": int(generated.group(1)),
        "frames": [caption for _, caption in gallery],
    }


def figures_on_page(figures: dict[str, Any]) -> list[str]:
    """The texts of :func:`page_figures` that the rendered page must contain (``document.body.innerText``):
    how ``demo/make_screenshot.py`` checks that the screenshot shows the figures it records."""
    return [
        figures["model"].removeprefix("Model ready: "),
        f"Prompt: {figures['prompt_tokens']:,} tokens, of which {figures['visual_tokens']:,} visual",
        f"Generated: {figures['generated_tokens']} token",
        figures["reply_line"],
        *figures["frames"],
    ]


def serve(
    app: Any,
    host: str = "127.0.0.1",
    port: int = 7860,
    share: bool = False,
    queue_size: int = 32,
    block: bool = True,
    max_file_size: str | None = "2gb",
) -> Any:
    """Queue (one generation at a time, ``queue_size`` waiting) and launch ``app``; uploads above
    ``max_file_size`` are refused by Gradio with a message.

    ``block=False`` returns right after the server is up (tests, and :func:`launch`, which then blocks in
    ``app.block_thread()``); call ``app.close()`` to stop it. A port that cannot be listened on raises
    Gradio's ``OSError``.
    """
    app.queue(default_concurrency_limit=1, max_size=queue_size)
    return app.launch(
        server_name=host,
        server_port=port,
        share=share,
        prevent_thread_lock=not block,
        quiet=not block,
        show_error=True,
        ssr_mode=False,
        max_file_size=max_file_size,
        theme=_theme(),
        css=CSS,
        footer_links=[],
    )


def launch(
    model: str = "keye-tiny",
    host: str = "127.0.0.1",
    port: int = 7860,
    share: bool = False,
    device: str | None = None,
    max_video_seconds: float | None = 600.0,
    queue_size: int = 32,
) -> None:
    """Start the demo (``keye demo``): begin loading ``model`` in the background and serve the page
    until interrupted.

    The port is checked first: when it is in use (or not allowed) a :class:`KeyeConfigError` naming it is
    raised before the model loads, and the page's address is printed only once the server is up.
    """
    from keye.demo.net import check_port, port_error

    check_port(host, port)
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # gradio's own start-up probes
    quiet_transformers()
    model_host = ModelHost(model, device=device).start()
    app = build_app(model_host, max_video_seconds)
    try:
        launched = serve(app, host, port, share, queue_size, block=False)
    except OSError as err:
        # Taken since the check: Gradio's own message suggests GRADIO_SERVER_PORT and a traceback follows it.
        raise port_error(host, port, OSError(errno.EADDRINUSE, str(err))) from None
    print(f"keye demo: http://{host}:{port} (model {model}, loading in the background; Ctrl-C stops)", flush=True)
    share_url = launched[2] if isinstance(launched, tuple) and len(launched) > 2 else None
    if share_url:
        print(f"keye demo: public link {share_url}", flush=True)
    app.block_thread()
