"""Sampling from a trained model: a KV-cached decode loop over any registered model family."""

from titanlab.generation.generate import generate
from titanlab.generation.sampling import SamplingParams, sample_next

__all__ = ["SamplingParams", "generate", "sample_next"]
