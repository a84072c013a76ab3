"""modelcarve: plan, run and verify how a transformer is split across devices.

Layers (each imports only those below it): spec (pure data) <- plan (pure cost model)
<- runtime (torch.distributed) | report <- verify <- serve <- commands <- cli. See ARCHITECTURE.md.
"""

__version__ = "0.1.0"
