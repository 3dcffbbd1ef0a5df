"""The SFT library under ``keye train sft``: its config schema (config.py), multi-answer rows as shared-prefix
trees (trees.py) and the optimizer step over load-balanced micro-batches (step.py)."""
