"""ONNX export of IR graphs, and running exported folders through ONNX Runtime."""
