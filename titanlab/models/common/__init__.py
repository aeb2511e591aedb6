"""Layers every decoder-only family shares: RoPE, GQA attention over SDPA, SwiGLU, the decoder.

A family (`titanlab/models/<name>/`) declares its args and flavors and builds on these; the
layers know nothing of parallelism (see `titanlab/distributed/`).
"""
