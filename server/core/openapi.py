"""The OpenAPI document (/openapi.json, /docs) with every route's real request body.

The routes parse their bodies themselves (server/openai/routes.py `_parse`, so that every error is a
400 naming the field rather than FastAPI's 422), which hides the models from FastAPI. A route
declares its model with `openapi_extra=request_body(Model)`; `install_openapi` puts the JSON
schemas of all declared models into the document's components, where those references point.
"""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

_REF = "#/components/schemas/{model}"
_declared: dict[str, type[BaseModel]] = {}


def request_body(model: type[BaseModel]) -> dict[str, Any]:
    """A route's `openapi_extra`: its JSON body is `model`."""
    _declared[model.__name__] = model
    schema = {"$ref": _REF.format(model=model.__name__)}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def install_openapi(app: FastAPI) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = get_openapi(title=app.title, version=app.version, description=app.description,
                                   routes=app.routes)
            _, definitions = models_json_schema([(m, "validation") for m in _declared.values()],
                                                ref_template=_REF)
            schemas = document.setdefault("components", {}).setdefault("schemas", {})
            schemas.update(definitions.get("$defs", {}))
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to customise it
