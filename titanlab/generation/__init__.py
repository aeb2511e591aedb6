"""Sampling from a trained model: a KV-cached decode loop over any registered model family,
checkpoint loading, tensor parallel decode, and the command (`cli`, run by
`python -m titanlab.generate`).

May import every package but `trainer` and the entry points.
"""

from titanlab.generation.generate import generate
from titanlab.generation.sampling import SamplingParams, sample_next

__all__ = ["SamplingParams", "generate", "sample_next"]
