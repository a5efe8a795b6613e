"""prefixrun.cli."""
