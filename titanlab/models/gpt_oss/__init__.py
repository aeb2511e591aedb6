"""gpt-oss model: architecture arguments, published flavors, and the plain-PyTorch model."""

from titanlab.models.gpt_oss.args import GptOssModelArgs, gpt_oss_flavors
from titanlab.models.gpt_oss.model import GptOssTransformer

__all__ = ["GptOssModelArgs", "GptOssTransformer", "gpt_oss_flavors"]
