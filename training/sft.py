"""SFT recipe entry point: ``python training/sft.py --config training/configs/tiny_synth.yaml [k=v ...]``.

Same as ``keye train sft``; the recipe itself lives in :mod:`keye.recipes.sft` so that the installed
``keye`` command can run it. Multi-GPU: ``torchrun --nproc_per_node N training/sft.py --config ...``.
"""

import sys

from keye.recipes.sft import main

if __name__ == "__main__":
    sys.exit(main())
