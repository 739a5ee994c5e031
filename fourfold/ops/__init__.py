"""Numerical building blocks: losses and what the (optional) Triton kernels share."""
