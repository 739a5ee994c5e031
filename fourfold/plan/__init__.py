"""Planning a run before it starts: what a config and layout will cost each rank (see `fourfold.plan.memory`)."""
