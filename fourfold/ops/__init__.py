"""Numerical building blocks used by training: losses and (optional) fused kernels."""
