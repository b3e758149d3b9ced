"""Building an ONNX graph node by node, with weights streamed to one external data file.

Each weight is converted (cast, transposed, repacked) when a translation first asks for it and
its bytes go straight to `model.onnx.data`; the ModelProto only records offsets. So the export
holds the graph's own weights plus one converted tensor at a time, and the protobuf never meets
its 2 GB limit.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper

DATA_FILE = "model.onnx.data"
# Offsets aligned so that a runtime may memory-map each tensor (ONNX's own default alignment).
_ALIGN = 4096

ONNX_DTYPES = {torch.float32: TensorProto.FLOAT, torch.float16: TensorProto.FLOAT16,
               torch.bfloat16: TensorProto.BFLOAT16, torch.int64: TensorProto.INT64,
               torch.int32: TensorProto.INT32, torch.int8: TensorProto.INT8,
               torch.uint8: TensorProto.UINT8, torch.bool: TensorProto.BOOL}
# Compute dtypes an export may have: ONNX Runtime's CPU kernels have no bfloat16 matmuls.
NP_DTYPES = {torch.float32: np.float32, torch.float16: np.float16}


class ExternalData:
    """Appends tensor bytes to one file and returns TensorProtos that point into it."""

    def __init__(self, folder: Path):
        self.path = Path(folder) / DATA_FILE
        self._f = open(self.path, "wb")
        self.nbytes = 0

    def add(self, name: str, t: torch.Tensor, onnx_type: int | None = None,
            dims: tuple[int, ...] | None = None) -> TensorProto:
        """`onnx_type`/`dims` override the tensor's own, for bytes that are already packed
        in the target layout (uint4 codes held as uint8 bytes)."""
        t = t.detach().to("cpu").contiguous()
        raw = t.view(torch.uint8).numpy().tobytes() if t.dtype == torch.bfloat16 else t.numpy().tobytes()
        pad = -self.nbytes % _ALIGN
        self._f.write(b"\0" * pad)
        offset = self.nbytes + pad
        self._f.write(raw)
        self.nbytes = offset + len(raw)
        tp = TensorProto()
        tp.name = name
        tp.data_type = onnx_type if onnx_type is not None else ONNX_DTYPES[t.dtype]
        tp.dims.extend(dims if dims is not None else t.shape)
        tp.data_location = TensorProto.EXTERNAL
        for k, v in (("location", DATA_FILE), ("offset", str(offset)), ("length", str(len(raw)))):
            e = tp.external_data.add()
            e.key, e.value = k, v
        return tp

    def close(self) -> None:
        self._f.close()


class GraphBuilder:
    """Nodes, inputs, outputs and initializers of one ONNX graph, with unique value names."""

    def __init__(self, data: ExternalData, dtype: torch.dtype):
        self.data, self.dtype = data, dtype
        self.onnx_dtype = ONNX_DTYPES[dtype]
        self.nodes: list[onnx.NodeProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self.initializers: list[TensorProto] = []
        self.domains: dict[str, int] = {}
        self._names: dict[str, int] = {}
        self._memo: dict = {}

    def fresh(self, base: str) -> str:
        n = self._names.get(base, 0)
        self._names[base] = n + 1
        return base if n == 0 else f"{base}_{n}"

    def op(self, op_type: str, inputs: list[str | None], n_out: int = 1, *, domain: str = "",
           name: str | None = None, outputs: list[str] | None = None, **attrs) -> str | list[str]:
        """Add one node; returns its output name (or names when n_out > 1). None = absent input."""
        base = name or op_type
        outs = outputs or [self.fresh(f"/{base}/out{i}" if n_out > 1 else f"/{base}/out") for i in range(n_out)]
        if domain:
            self.domains.setdefault(domain, 1)
        ins = ["" if i is None else i for i in inputs]
        while ins and ins[-1] == "":
            ins.pop()
        self.nodes.append(helper.make_node(op_type, ins, outs, name=self.fresh(base), domain=domain,
                                           **{k: v for k, v in attrs.items() if v is not None}))
        return outs[0] if n_out == 1 else outs

    def const(self, value, dtype=None, name: str = "const") -> str:
        """A small constant (shapes, eps, frequencies) stored inline in the protobuf."""
        arr = np.asarray(value, dtype=dtype)
        key = ("const", arr.dtype.str, arr.shape, arr.tobytes())
        if key not in self._memo:
            n = self.fresh(f"/const/{name}")
            self.initializers.append(onnx.numpy_helper.from_array(arr, n))
            self._memo[key] = n
        return self._memo[key]

    def scalar(self, value: float) -> str:
        """A scalar in the model's compute dtype."""
        return self.const(value, dtype=NP_DTYPES[self.dtype], name="scalar")

    def weight(self, key: str, make: Callable[[], torch.Tensor], *, onnx_type: int | None = None,
               dims: tuple[int, ...] | None = None) -> str:
        """A weight written once under `key` (the IR name plus how it was converted)."""
        if ("w", key) not in self._memo:
            self.initializers.append(self.data.add(key, make(), onnx_type, dims))
            self._memo[("w", key)] = key
        return key

    def memo(self, key, make: Callable[[], object]):
        """Values shared by many nodes (RoPE tables, the attention mask), built once."""
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]

    def cast(self, x: str, to: int) -> str:
        return self.op("Cast", [x], to=to)

    def to_compute(self, x: str, from_type: int) -> str:
        return x if from_type == self.onnx_dtype else self.cast(x, self.onnx_dtype)

    def add_input(self, name: str, elem: int, shape: list) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, elem, shape))
        return name

    def add_output(self, name: str, elem: int, shape: list) -> None:
        self.outputs.append(helper.make_tensor_value_info(name, elem, shape))

    def model(self, opset: int, producer: str) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, "llmaccel", self.inputs, self.outputs, self.initializers)
        imports = [helper.make_opsetid("", opset)] + [helper.make_opsetid(d, v) for d, v in self.domains.items()]
        m = helper.make_model(graph, opset_imports=imports, producer_name=producer)
        m.ir_version = 10
        return m
