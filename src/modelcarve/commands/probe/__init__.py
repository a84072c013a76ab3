"""``hardware --probe``: this machine measured as a cluster file the planner reads.

``machine.py`` runs the probe (GEMM, GEMV, copy and gloo collectives on the ranks, the bare engine's
host costs) and writes the cluster file (``run_probe``, ``cluster_dict``); ``served.py`` serves the
tiny probe models and times them through bench-serve's client; ``pipeline.py`` times the runtime's
pipeline schedule's host work per action.
"""
