"""What every protocol shares: the engine's state, a request's run, errors, metrics, SSE, keep-alive, OpenAPI."""
