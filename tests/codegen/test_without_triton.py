"""Without triton every kernel module imports (its reference and CPU forms work), and what is
slower is said on one line of stderr, once per process."""
import subprocess
import sys

from llmaccel.codegen.kernel_ops import _slower_notice

# `import triton` fails in this process as it does where triton is not installed
_PROBE = """
import sys
sys.modules["triton"] = None
import torch
torch.cuda.is_available = lambda: {cuda}
from llmaccel.codegen.kernel_ops import load_kernel_modules
from llmaccel.codegen.lower import cpu_forms
print({{k: v for k, v in load_kernel_modules().items() if v != "ok"}})
load_kernel_modules()
print(sorted(cpu_forms()))
"""


def _run(cuda: bool) -> tuple[list[str], list[str]]:
    p = subprocess.run([sys.executable, "-c", _PROBE.format(cuda=cuda)], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return p.stdout.splitlines(), [line for line in p.stderr.splitlines() if line.strip()]


def test_kernel_modules_import_without_triton():
    out, err = _run(cuda=False)
    assert out[0] == "{}"  # no module failed
    assert "linear_int4" in out[1] and "linear_int8" in out[1]  # the CPU forms of quant linears
    assert err == []  # on the CPU nothing is slower without triton


def test_one_line_once_when_cuda_would_use_triton():
    out, err = _run(cuda=True)
    assert out[0] == "{}"
    assert len(err) == 1 and err[0].startswith("llmaccel: triton is not installed: on CUDA"), err


def test_a_module_that_fails_is_named_on_one_line():
    msg = _slower_notice({"norm": "ok", "gemv": "ImportError: no name 'x'", "sla": "RuntimeError: y"})
    assert "\n" not in msg and msg.startswith("kernel modules gemv, sla did not import (ImportError")
