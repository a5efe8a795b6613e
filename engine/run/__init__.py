"""Running windows: the engine, the executor of a plan, the session that builds an engine."""
