"""Training: one step for any layout, a rank's life under torchrun, signals, and the launcher's supervision."""
