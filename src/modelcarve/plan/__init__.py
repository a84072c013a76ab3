"""Pure-Python cost model and search: memory, compute, communication, schedules, goals. Never imports torch."""
