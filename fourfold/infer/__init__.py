"""Inference: sampling and generation (the full engine comes later)."""
