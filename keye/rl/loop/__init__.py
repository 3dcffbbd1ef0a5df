"""The pieces of the one RL loop (:func:`keye.recipes.rlep.train`): what a run is built of (components.py), the
in-process batch source and the update preparation (batcher.py), prompt stream / pool / trainer state
(state.py), held-out evaluation (evaluate.py), step metrics and the run log (metrics.py), and RLEP phase A
(collect.py), and the asynchronous batch source (streaming.py), which Ray feeds with workers (:mod:`keye.rl.distributed`)."""
