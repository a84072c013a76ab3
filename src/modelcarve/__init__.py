"""modelcarve: plan, run and verify how a transformer is split across devices.

Layers (each imports only those above it): spec (pure data) -> plan (pure cost model)
-> runtime (torch.distributed) -> verify -> report -> cli. See DESIGN.md.
"""

__version__ = "0.1.0"
