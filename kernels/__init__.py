"""kvpool.kernels."""
