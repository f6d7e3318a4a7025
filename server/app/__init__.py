"""The FastAPI application: routers of every protocol, API keys, body limits."""
