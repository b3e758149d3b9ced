import pytest

from llmaccel.compiler.pipeline import compile
from llmaccel.errors import LlmaccelError
from llmaccel.compiler.registry import get_pass, registry
from llmaccel.passes.base import make_config, parse_sets


def test_registry_names_match_files():
    for name, cls in registry().items():
        assert cls.name == name and cls.__module__ in (f"llmaccel.passes.{name}", f"llmaccel.{name}.{name}")


def test_unknown_pass_lists_known():
    with pytest.raises(LlmaccelError, match="known passes: fuse"):
        get_pass("nope")


def test_typed_options():
    cfg = make_config(get_pass("fuse"), {"norms": "false", "linears": "yes"})
    assert cfg.norms is False and cfg.linears is True
    with pytest.raises(LlmaccelError, match="expected true or false"):
        make_config(get_pass("fuse"), {"norms": "sometimes"})
    with pytest.raises(LlmaccelError, match="options of fuse: norms, linears, add_norm"):
        make_config(get_pass("fuse"), {"bits": "4"})


def test_parse_sets():
    assert parse_sets(["fuse.norms=false", "quant.bits=4"]) == {"fuse": {"norms": "false"}, "quant": {"bits": "4"}}
    for bad in ["fuse", "fuse=1", ".x=1", "fuse.=1"]:
        with pytest.raises(LlmaccelError, match="PASS.KEY=VALUE"):
            parse_sets([bad])


def test_options_for_pass_not_in_list():
    with pytest.raises(LlmaccelError, match="not in the pass list"):
        compile("preset:tiny-llama", [], {"fuse": {"norms": "false"}}, progress=False)


def test_pass_order_and_repeats_refused_before_any_work():
    import time

    t = time.perf_counter()
    with pytest.raises(LlmaccelError, match=r"gqa must run before quant.*--passes gqa,quant"):
        compile("preset:tiny-llama", ["quant", "gqa"], progress=False, eval_tokens=0)
    with pytest.raises(LlmaccelError, match="bitlinear must run before fuse"):
        compile("preset:tiny-llama", "fuse,bitlinear", progress=False, eval_tokens=0)
    with pytest.raises(LlmaccelError, match="listed twice"):
        compile("preset:tiny-llama", "quant,quant", progress=False, eval_tokens=0)
    assert time.perf_counter() - t < 5  # refused before loading or calibrating anything


FAST = {"quant": {"method": "rtn"}, "sla": {"init": "zeros"}}
ORDERED = [(p, q) for p in registry() for q in get_pass(p).before]


def test_every_order_a_pass_needs_is_declared():
    """Each pair a pass reads the graph of before the other rewrites it (found by compiling
    every pair both ways): refused up front in the wrong order, not half-way through. (repbn
    after fuse is refused by repbn itself, at its start: with fuse.add_norm=false it applies.)"""
    assert set(ORDERED) >= {("relu", "quant"), ("relu", "bitlinear"),
                            ("bitlinear", "fuse"), ("bitlinear", "quant"), ("gqa", "quant"),
                            ("gqa", "bitlinear"), ("gqa", "kvquant"), ("gqa", "sla")}


@pytest.mark.parametrize("first,then", ORDERED)
def test_a_declared_order_compiles_and_its_reverse_is_refused(first, then):
    opts = {k: v for k, v in FAST.items() if k in (first, then)}
    compile("preset:tiny-llama", [first, then], opts, progress=False, eval_tokens=0)
    with pytest.raises(LlmaccelError, match=f"{first} must run before {then}"):
        compile("preset:tiny-llama", [then, first], opts, progress=False, eval_tokens=0)
