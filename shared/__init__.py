"""kvpool.shared."""
