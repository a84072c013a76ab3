"""The cost primitives every goal shares: collectives, GEMM efficiency, activation bytes, pipeline schedules, serving dtypes,
the element-wise work a framework leaves unfused."""
