"""llmaccel: an LLM inference compiler and runtime."""
import functools

from llmaccel.compiler import pipeline
from llmaccel.compiler.model import load
from llmaccel.runtime.engine import LLM
from llmaccel.runtime.windows import sample_windows
from llmaccel.sampling import SamplingParams


@functools.wraps(pipeline.compile)
def compile(*args, **kwargs):
    kwargs.setdefault("sampler", sample_windows)  # the engine, for passes that generate text
    return pipeline.compile(*args, **kwargs)


__all__ = ["compile", "load", "LLM", "SamplingParams"]
__version__ = "0.1.0"
