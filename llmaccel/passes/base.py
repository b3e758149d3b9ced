"""Pass protocol, pass context and typed option parsing."""
from __future__ import annotations

import dataclasses
import sys
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Literal, get_args, get_origin

import torch
import torch.fx

from llmaccel.config import ModelConfig
from llmaccel.errors import LlmaccelError


@dataclass
class PassResult:
    gm: torch.fx.GraphModule
    changed: int
    stats: dict[str, Any] = field(default_factory=dict)


class Progress:
    """Progress reporter handed to passes: a tqdm bar per long loop, on stderr."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled

    def __call__(self, iterable, desc: str, total: int | None = None, unit: str = "it"):
        from tqdm import tqdm

        return tqdm(iterable, desc=desc, total=total, unit=unit, disable=not self.enabled,
                    file=sys.stderr)

    def log(self, msg: str) -> None:
        if self.enabled:
            from tqdm import tqdm

            tqdm.write(msg, file=sys.stderr)  # on a line of its own above a bar that is running


@dataclass
class PassContext:
    config: ModelConfig
    device: str = "cpu"
    progress: Progress = field(default_factory=Progress)
    # Returns calibration token ids of shape (n_samples, seq_len); computed on first use.
    calib_source: Callable[[int, int], torch.Tensor] | None = None
    source_model: Any = None  # the model before any pass, for passes that distil against it
    # Whether a pass that trains the graph (Pass.trains: heal) runs after the current one: a
    # pass with a training form (Pass.training_form) emits it only then.
    trained: bool = False
    # Continues token-id prompts with a model: sampler(model, prompts, length, seed=, max_seqs=)
    # -> ((n, length) ids, stats). The engine's runtime.windows.sample_windows, handed down by
    # the frontends (the engine sits above the passes); None where nobody handed one.
    sampler: Callable | None = None
    _calib_cache: dict = field(default_factory=dict)

    def calib_tokens(self, n_samples: int, seq_len: int) -> torch.Tensor:
        if self.calib_source is None:
            raise LlmaccelError("this pass needs calibration data and none was given (--calib)")
        key = (n_samples, seq_len)
        if key not in self._calib_cache:
            self._calib_cache[key] = self.calib_source(n_samples, seq_len)
        return self._calib_cache[key]


@dataclass
class NoOptions:
    pass


class Pass:
    name: ClassVar[str]
    summary: ClassVar[str]
    exact: ClassVar[bool] = True
    config_cls: ClassVar[type] = NoOptions
    # passes that must not run before this one (they rewrite what it reads); the pipeline
    # refuses such an order before any work
    before: ClassVar[tuple[str, ...]] = ()

    def __init__(self, config=None):
        self.config = config if config is not None else self.config_cls()

    def run(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
        raise NotImplementedError

    def start(self, ctx: PassContext) -> None:
        """Called on every pass of a compile before the first one runs: work that needs nothing
        from the earlier passes may begin here, to overlap them (heal: its sampling process)."""

    def close(self) -> None:
        """Called on every pass once the compile's passes end, failed or not: ends what start()
        began and run() did not take."""

    # A pass that trains the graph it is given (heal): the passes before it emit their training
    # forms (PassContext.trained).
    trains: ClassVar[bool] = False

    @classmethod
    def training_form(cls, gm: torch.fx.GraphModule) -> "TrainingForm | None":
        """This pass's training form in `gm`, for a training pass to move and finish: a pass
        whose inference form cannot be trained directly (a progressive blend that ends in a
        folded op, packed weights that need a straight-through estimator) emits one when
        PassContext.trained. Its schedule and finish are no-ops on a graph without it."""
        return None


@dataclass
class TrainingForm:
    """schedule(frac): the training form at training progress frac in [0, 1] (1 = as the
    untrained inference form); finish(): replaced in place by the inference form, its stats
    (empty if there was none)."""
    schedule: Callable[[float], None]
    finish: Callable[[], dict[str, Any]]


def option_fields(config_cls: type) -> dict[str, tuple[Any, Any]]:
    """Field name -> (type, default) of a pass config dataclass."""
    hints = typing.get_type_hints(config_cls)
    return {f.name: (hints[f.name], f.default) for f in dataclasses.fields(config_cls)}


def describe_type(tp) -> str:
    if get_origin(tp) is Literal:
        return "|".join(str(a) for a in get_args(tp))
    return getattr(tp, "__name__", str(tp))


def parse_value(pass_name: str, key: str, tp, raw: str):
    where = f"{pass_name}.{key}={raw}"
    if get_origin(tp) is Literal:
        for choice in get_args(tp):
            if str(choice) == raw:
                return choice
        raise LlmaccelError(f"{where}: expected one of {describe_type(tp)}")
    if tp is bool:
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off"):
            return False
        raise LlmaccelError(f"{where}: expected true or false")
    try:
        return tp(raw)
    except (TypeError, ValueError):
        raise LlmaccelError(f"{where}: expected {describe_type(tp)}") from None


def make_config(pass_cls: type[Pass], raw: dict[str, Any]):
    """Fill a pass's config from {key: value}; strings are parsed by the field's type."""
    fields = option_fields(pass_cls.config_cls)
    values = {}
    for key, val in raw.items():
        if key not in fields:
            known = ", ".join(fields) or "none"
            raise LlmaccelError(f"unknown option {pass_cls.name}.{key}; options of {pass_cls.name}: {known}")
        tp = fields[key][0]
        values[key] = parse_value(pass_cls.name, key, tp, val) if isinstance(val, str) else val
    try:
        return pass_cls.config_cls(**values)
    except (TypeError, ValueError) as e:
        raise LlmaccelError(f"{pass_cls.name}: {e}") from e


def parse_sets(items: list[str]) -> dict[str, dict[str, str]]:
    """['quant.bits=4', ...] -> {'quant': {'bits': '4'}}."""
    out: dict[str, dict[str, str]] = {}
    for item in items:
        key, eq, val = item.partition("=")
        name, dot, opt = key.partition(".")
        if not eq or not dot or not name or not opt:
            raise LlmaccelError(f"--set {item!r}: expected PASS.KEY=VALUE")
        out.setdefault(name.strip(), {})[opt.strip()] = val.strip()
    return out
