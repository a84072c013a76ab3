"""The single-device reference model, in plain PyTorch: every layout is checked against it and every parallelism is applied to it."""
