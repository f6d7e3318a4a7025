"""The FastAPI app: routes at / and /v1 (OpenAI's chat and Responses, Anthropic's Messages), their error
shapes, keys, body limit, lifecycle."""
from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from engine.config import FdserveConfig
from server import __version__
from server.anthropic.routes import router as messages_router
from server.app.auth import APIKeyMiddleware
from server.app.limits import BodyLimitMiddleware
from server.core.engine_client import EngineClient
from server.core.errors import install_error_handlers
from server.core.openapi import install_openapi
from server.core.state import EngineFactory, ServerState, default_engine_factory
from server.openai.routes import router
from server.responses.routes import router as responses_router

DESCRIPTION = ("OpenAI-compatible LLM server. Every route also answers without the /v1 prefix. "
               "With [api] api_key set, /v1 routes need `Authorization: Bearer <key>`.")


def build_app(config: FdserveConfig, engine: EngineClient | None = None,
              engine_factory: EngineFactory = default_engine_factory) -> FastAPI:
    """With `engine` given (tests), the app serves it and leaves its lifecycle to the caller;
    otherwise the model loads in the background at startup and is drained on shutdown."""
    state = ServerState(config, engine)
    owns_engine = engine is None

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if owns_engine:
            state.load_in_background(engine_factory)
        else:
            state.log_ready()
        yield
        if owns_engine:
            # uvicorn has already waited for the requests in flight (SIGTERM); drain what is left.
            await state.shutdown(config.server.request_timeout)

    app = FastAPI(title="fdserve", version=__version__, lifespan=lifespan, description=DESCRIPTION,
                  docs_url="/docs", redoc_url=None, openapi_url="/openapi.json")
    app.state.fdserve = state
    install_error_handlers(app)
    install_openapi(app)
    app.include_router(router, include_in_schema=False)   # the same routes; the document lists /v1
    app.include_router(router, prefix="/v1")
    app.include_router(messages_router, include_in_schema=False)
    app.include_router(messages_router, prefix="/v1")
    app.include_router(responses_router, include_in_schema=False)
    app.include_router(responses_router, prefix="/v1")
    # Starlette runs the last-added middleware first: keys are checked before any body is read.
    app.add_middleware(BodyLimitMiddleware, max_bytes=config.server.max_body_bytes)
    app.add_middleware(APIKeyMiddleware, keys=config.api.api_keys)
    return app
