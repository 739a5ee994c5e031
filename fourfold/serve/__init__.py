"""fourfold serve: an OpenAI-compatible HTTP server over the inference engine (needs the serve extra)."""
