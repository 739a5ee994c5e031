"""Llama model definitions and named presets."""
