"""Inference: the paged-KV-cache engine (LLMEngine), the offline LLM API, the async streaming API, loading."""
