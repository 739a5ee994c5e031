"""Training: trainer loop, data pipeline, checkpoints and metrics."""
