"""The kernels' custom ops as the lowering sees them: every kernel module imported once (so
its ops are registered), an op looked up by name, whether a node's arguments fit its schema."""
from __future__ import annotations

import functools
import importlib
import pkgutil
import sys

import torch
import torch.fx


@functools.cache
def load_kernel_modules() -> dict[str, str]:
    """Import every module of llmaccel.kernels once, so their custom ops are registered.

    Returns {module: "ok" | error}; a module that fails to import only loses its ops. What is
    slower for it is said once per process, on one line of stderr.
    """
    loaded: dict[str, str] = {}
    try:
        import llmaccel.kernels as pkg
    except ImportError:
        return loaded
    for info in pkgutil.iter_modules(pkg.__path__):
        name = f"llmaccel.kernels.{info.name}"
        try:
            importlib.import_module(name)
            loaded[info.name] = "ok"
        except Exception as e:  # e.g. a Triton build that lacks a feature: keep the reference
            first = (str(e).splitlines() or [""])[0]
            loaded[info.name] = f"{type(e).__name__}: {first}"
    notice = _slower_notice(loaded)
    if notice:
        print(f"llmaccel: {notice}", file=sys.stderr)
    return loaded


def _slower_notice(loaded: dict[str, str]) -> str | None:
    """What runs slower in this process than with every kernel module and triton, or None."""
    failed = [name for name, status in loaded.items() if status != "ok"]
    if failed:
        return (f"kernel modules {', '.join(failed)} did not import ({loaded[failed[0]]}); "
                f"their ops run the torch references, slower")
    try:
        import triton  # noqa: F401
    except ImportError:
        # The CPU paths never use triton; on CUDA every kernel op falls back to its reference.
        if torch.cuda.is_available():
            return ("triton is not installed: on CUDA the attention, quantized and fused linears, "
                    "norms and sampling run their torch references, slower (pip install triton)")
    return None


def custom_op(namespace: str, name: str):
    ns = getattr(torch.ops, namespace)
    return getattr(ns, name) if hasattr(ns, name) else None


def _plain(v) -> bool:
    if isinstance(v, (list, tuple)):
        return all(_plain(x) for x in v)
    return v is None or isinstance(v, (torch.fx.Node, bool, int, float, str, torch.dtype))


def accepts(op, node: torch.fx.Node) -> bool:
    """Whether custom op `op` can be called with the node's args and kwargs as they are."""
    schema = op.default._schema
    args = list(schema.arguments)
    positional = [a for a in args if not a.kwarg_only]
    if len(node.args) > len(positional):
        return False
    by_position = {a.name for a in positional[: len(node.args)]}
    if not set(node.kwargs) <= {a.name for a in args} - by_position:
        return False
    given = by_position | set(node.kwargs)
    if any(a.name not in given and not a.has_default_value() for a in args):
        return False
    return all(_plain(v) for v in (*node.args, *node.kwargs.values()))


def retarget(node: torch.fx.Node, target) -> None:
    node.target = target
    # A node traced from an fx.wrap'ed op carries is_wrapped, which makes the generated code
    # re-register its target's name with fx.wrap; for a new target that name breaks later traces.
    node.meta.pop("is_wrapped", None)
