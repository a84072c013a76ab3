"""Measurements of a run, and of a layout without running it: counters, memory by category, the pipeline timeline, the dry run."""
