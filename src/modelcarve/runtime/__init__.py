"""torch.distributed runtime: the reference model, each parallelism as its own module, training."""
