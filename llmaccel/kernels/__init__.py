"""Triton kernels, one module per op family, each registered as torch.ops.llmaccel.* custom ops."""
