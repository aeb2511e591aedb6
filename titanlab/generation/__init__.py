"""Sampling from a trained model: a KV-cached decode loop over any registered model family,
checkpoint loading, tensor parallel decode, and the command (`cli`, run by
`python -m titanlab.generate`).

May import `config`, `models`, `distributed`, `data` and `checkpoint`: it sits below
`components`, so reinforcement learning's rollouts (`posttrain.rl`) share its sampling.
"""

from titanlab.generation.generate import generate
from titanlab.generation.mtp_draft import DraftStats
from titanlab.generation.sampling import SamplingParams, sample_next

__all__ = ["DraftStats", "SamplingParams", "generate", "sample_next"]
