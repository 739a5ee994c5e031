"""Parallelism applied to the model from outside: data, tensor, sequence, context and pipeline."""
