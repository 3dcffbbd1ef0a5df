"""Helpers that build tiny, fully offline fixtures (models, tokenizers, processors, media) for tests,
benchmarks and examples. Nothing here downloads anything."""
