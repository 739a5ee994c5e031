"""fourfold: train and serve Llama-family models across many GPUs with composable 4-D parallelism."""

__version__ = "0.1.0"
