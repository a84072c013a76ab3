"""The parallelisms, each its own module, and parallelize.py: the one place that applies them to the reference model."""
