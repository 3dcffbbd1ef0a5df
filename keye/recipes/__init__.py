"""The recipes on top of the libraries: :mod:`keye.recipes.sft` (``keye train sft``) and
:mod:`keye.recipes.rlep` (``keye train rlep``: one RL loop for every engine), their shared entry point
(:mod:`keye.recipes.common`) and their commands (:mod:`keye.recipes.cli`)."""
