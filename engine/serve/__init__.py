"""`kiln serve`: the OpenAI-compatible server, admission, scheduling, metrics, and a fake engine for load tests."""
