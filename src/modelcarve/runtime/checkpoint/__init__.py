"""Checkpoints: Hugging Face weights in, DCP training states saved and resumed, atomic commit, export to a Hugging Face directory."""
