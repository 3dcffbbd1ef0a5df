"""The RL algorithm library: pure functions and small state over rollout samples, no engines, no process groups.

- advantages.py: group-normalised advantages (GRPO, Dr.GRPO), RLEP advantages over enlarged groups, difficulty curves;
- losses.py: the PPO-family policy loss (clip-higher, dual clip, GSPO, TIS, KL, entropy) and its aggregations;
- sampling.py: dynamic sampling, accuracy-based prompt filtering, thinking-mode mixes, mini-batches of whole groups;
- update.py: scores and advantages onto samples, the reference update path used by tests and benchmarks;
- replay.py: the RLEP replay pool and the replayed rows of phase B;
- autothink.py: the AutoThink mode-selection reward and its linked auto / think / direct groups.
"""
