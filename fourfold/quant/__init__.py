"""Quantization: float8 training (torchao) and, later, quantization-aware training and conversion."""
