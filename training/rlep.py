"""RLEP recipe entry point: ``python training/rlep.py --config training/configs/tiny_synth_rlep.yaml [k=v ...]``.

Same as ``keye train rlep``; the recipe itself lives in :mod:`keye.recipes.rlep` so that the installed
``keye`` command can run it. Multi-GPU: ``torchrun --nproc_per_node N training/rlep.py --config ...``.
"""

import sys

from keye.recipes.rlep import main

if __name__ == "__main__":
    sys.exit(main())
