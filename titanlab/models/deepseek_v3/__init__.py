"""DeepSeek-V3: architecture arguments, published flavors, and the plain-PyTorch model."""

from titanlab.models.deepseek_v3.args import DeepSeekV3ModelArgs, deepseek_v3_flavors
from titanlab.models.deepseek_v3.model import DeepSeekV3Transformer

__all__ = ["DeepSeekV3ModelArgs", "DeepSeekV3Transformer", "deepseek_v3_flavors"]
