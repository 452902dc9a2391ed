"""The DeepSeek-V4 model over flat batches of tokens from many requests, and its cache storage."""

from ds4.model.batch import ForwardBatch
from ds4.model.cache import ModelCache, bytes_per_page, bytes_per_slot
from ds4.model.deepseek_v4 import DeepseekV4Model

__all__ = ["DeepseekV4Model", "ForwardBatch", "ModelCache", "bytes_per_page", "bytes_per_slot"]
