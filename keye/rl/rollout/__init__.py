"""Producing RL samples: the records (samples.py), response masks (masks.py), prompts from a manifest
(prompts.py), the sampling settings every engine and the learner share (settings.py), the engines (engines.py:
in-process and vLLM) and the reward scoring of samples (scoring.py)."""
