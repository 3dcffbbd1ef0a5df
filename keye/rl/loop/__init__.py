"""The pieces of the one RL loop (:func:`keye.recipes.rlep.train`): what a run is built of (components.py), the
in-process batch source and the update preparation (batcher.py), prompt stream / pool / trainer state
(state.py), held-out evaluation (evaluate.py), step metrics and the run log (metrics.py), and RLEP phase A
(collect.py). The asynchronous batch source lives with the Ray runtime (:mod:`keye.rl.distributed.streaming`)."""
