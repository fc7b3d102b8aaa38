"""The OpenAI-compatible HTTP API (Litestar), stateless: run as many replicas as you like."""
