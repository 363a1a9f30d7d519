"""kvpool.manager."""
