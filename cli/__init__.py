"""kvpool.cli."""
