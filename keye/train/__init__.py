"""Training recipes' shared machinery: typed configs, distributed wrapping, checkpoints, SFT loop."""
