"""The custom ops' schemas as every supported torch dispatches them."""
import torch

from llmaccel.codegen.kernel_ops import load_kernel_modules


def _llmaccel_schemas():
    load_kernel_modules()
    return [s for s in torch._C._jit_get_all_schemas() if s.name.startswith("llmaccel::")]


def test_mutated_arguments_have_no_defaults():
    # The dispatcher drops trailing arguments left at their defaults, and torch 2.11's
    # ADInplaceOrView kernel of a custom op indexes the mutated ones by position without filling
    # them back: an optional mutated argument with a default failed every call that left it out.
    schemas = _llmaccel_schemas()
    assert any(s.name == "llmaccel::paged_decode_attention" for s in schemas)
    bad = [f"{s.name}({a.name})" for s in schemas for a in s.arguments
           if a.alias_info is not None and a.alias_info.is_write and a.has_default_value()]
    assert not bad, bad
