"""Checkpoints: sharded-safe save and load of model and optimizer state, by parameter name."""
