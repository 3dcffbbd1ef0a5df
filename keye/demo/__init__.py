"""The Gradio video Q&A demo (``keye demo``) and the terminal chat (``keye chat``).

Public pieces: :func:`keye.demo.app.build_app` / :func:`keye.demo.app.launch` (the web page),
:class:`keye.demo.engine.ModelHost` (background model loading), :class:`keye.demo.session.ChatSession`
with :func:`keye.demo.session.check_media`, :func:`keye.demo.session.stream_reply` and
:func:`keye.demo.session.reply_stats` (the mode / token line under an answer; shared by both),
and :func:`keye.demo.frames.seen_frames` (the frames the model saw, rebuilt from a processed batch).
Gradio is imported only by ``keye.demo.app``.
"""
