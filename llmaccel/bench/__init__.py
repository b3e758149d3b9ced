"""llmc bench: prefill and decode speed, memory and roofline of the static-batch decode path."""
