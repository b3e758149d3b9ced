"""The package's layers: every import (module level or inside a function) goes down or sideways.

Bottom to top: errors/config; the IR (graph helpers, op references, quantization math); kernels
and the sampler; passes; the heal (training a transformed graph); lowering; the compiler (sources, capture, pipeline, artifacts, the
reference executor) with the evaluation tools its reports use; the engine (runtime); the frontends (CLI, benchmarks, server,
export, the torch.compile backend, the package root). KNOWN lists the upward imports that
remain, each with why; a new one fails this test, and one that is gone must leave the list.
"""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "llmaccel"

LAYERS = [
    {"errors", "config"},
    {"ir", "ops", "quant", "eval.text", "eval.domains", "eval.prompts"},  # eval.text: calibration
    # text, files or samples of a model; eval.domains: the evaluation texts of several domains and
    # their scores; eval.prompts: openings of text of many kinds (plain strings)
    {"kernels", "sampling"},
    {"passes"},
    {"heal"},
    {"codegen", "parallel"},  # parallel: the tensor-parallel sharding of a graph at load
    {"compiler", "eval"},
    {"runtime"},
    {"cli", "bench", "serve", "export", "codegen.backend", "__init__"},
]

KNOWN: set[tuple[str, str]] = set()


def _unit(mod: str) -> str:
    """The layer unit of a dotted module name below llmaccel (a module may sit above its package)."""
    parts = mod.split(".")
    if ".".join(parts[:2]) in {u for layer in LAYERS for u in layer}:
        return ".".join(parts[:2])
    return parts[0]


def _level(unit: str) -> int:
    for i, layer in enumerate(LAYERS):
        if unit in layer:
            return i
    raise AssertionError(f"llmaccel.{unit} belongs to no layer: add it to LAYERS")


def _modules() -> dict[str, Path]:
    out = {}
    for p in ROOT.rglob("*.py"):
        rel = p.relative_to(ROOT).with_suffix("")
        name = ".".join(rel.parts)
        out[name.removesuffix(".__init__") or "__init__"] = p
    return out


def _imports(mods: dict[str, Path]):
    for mod, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                    and node.module.startswith("llmaccel"):
                base = node.module.removeprefix("llmaccel").lstrip(".")
                for a in node.names:  # `from llmaccel import ops` imports llmaccel.ops
                    full = f"{base}.{a.name}".lstrip(".")
                    targets.append(full if full in mods else base or "__init__")
            elif isinstance(node, ast.Import):
                targets = [a.name.removeprefix("llmaccel").lstrip(".") or "__init__"
                           for a in node.names if a.name.split(".")[0] == "llmaccel"]
            for t in targets:
                yield mod, t


def _upward():
    mods = _modules()
    found = set()
    for mod, target in _imports(mods):
        a, b = _unit(mod), _unit(target)
        if a != b and _level(b) > _level(a):
            found.add((mod, target))
    return found


def test_imports_go_down():
    up = _upward()
    new = sorted(up - KNOWN)
    assert not new, "upward imports (module -> imported module): " + "; ".join(f"{a} -> {b}" for a, b in new)
    gone = sorted(KNOWN - up)
    assert not gone, f"no longer imported, drop from KNOWN: {gone}"


def test_every_module_has_a_layer():
    for mod in _modules():
        _level(_unit(mod))
