"""Codegen: lowering the IR to custom ops, the static-KV decode engine, the torch.compile backend."""
