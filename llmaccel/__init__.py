"""llmaccel: an LLM inference compiler and runtime."""
from llmaccel.compiler.model import load
from llmaccel.compiler.pipeline import compile
from llmaccel.runtime.engine import LLM
from llmaccel.sampling import SamplingParams

__all__ = ["compile", "load", "LLM", "SamplingParams"]
__version__ = "0.1.0"
