"""verify: a layout against the single-device reference (reference.py), against the planner (against_plan.py), and against transformers (against_transformers.py)."""
