"""ds4: a fast, compact, exact serving engine for DeepSeek-V4-family models."""

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    # Lazy, so `import ds4` (and the CLI's start) does not pay for torch until a model is wanted.
    if name == "LLM":
        from ds4.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from ds4.engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'ds4' has no attribute {name!r}")
