"""prefixrun.engine."""
