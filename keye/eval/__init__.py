"""Benchmark evaluation: official prompts, answer extraction and scoring, batched resumable inference.

Modules: :mod:`~keye.eval.mmmu`, :mod:`~keye.eval.mathvista`, :mod:`~keye.eval.videoqa` (Video-MME style),
:mod:`~keye.eval.synth` (the synthetic set), :mod:`~keye.eval.keyechat` (Keye's response post-processing
and thinking-mode switches), :mod:`~keye.eval.runner` (engines, resumable predictions, data parallel),
:mod:`~keye.eval.extract` (our documented letter / number rules where no official rule exists),
:mod:`~keye.eval.report` (markdown / JSON reports), :mod:`~keye.eval.modes` (thinking-mode breakdown,
pass-rate buckets, :func:`~keye.eval.modes.paired_diff`), :mod:`~keye.eval.cli` (``keye eval``).
"""
