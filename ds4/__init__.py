"""ds4: a fast, compact, exact serving engine for DeepSeek-V4-family models."""

__version__ = "0.1.0"
