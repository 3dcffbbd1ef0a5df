"""Benchmark evaluation: official prompts, answer extraction and scoring, batched resumable inference.

Modules: :mod:`~keye.eval.mmmu`, :mod:`~keye.eval.mathvista`, :mod:`~keye.eval.videoqa` (Video-MME style),
:mod:`~keye.eval.synth` (the synthetic set), :mod:`~keye.eval.keyechat` (Keye's response post-processing
and thinking-mode switches, applied to benchmark conversations), :mod:`~keye.eval.runner` (engines, data
parallel), :mod:`~keye.eval.report` (markdown / JSON reports), :mod:`~keye.eval.modes` (thinking-mode
breakdown, pass-rate buckets, :func:`~keye.eval.modes.paired_diff`), :mod:`~keye.eval.cli` (``keye eval``).

What the data pipeline shares lives below this package and is re-exported where it used to be: our letter /
number rules (:mod:`keye.rewards.answers`, was ``keye.eval.extract``), the synthetic set's answer check
(:mod:`keye.data.synth_answers`) and the resumable predictions file (:mod:`keye.data.records`).
"""
