"""The HTTP API (FastAPI): OpenAI's /v1/chat/completions, /v1/completions and /v1/models, plus
/health and Prometheus /metrics. Handlers only parse, submit and relay (``routes``): every model
call happens on the engine's worker thread. With ``Settings.api_key`` the /v1 routes ask for it
(``auth``)."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

from fastapi import FastAPI

from .auth import KeyGuard
from .engine import Engine
from .errors import BadRequest
from .routes import Routes
from .settings import api_keys


def create_app(engine: Engine, stop_engine_on_shutdown: bool = True) -> FastAPI:
    app = FastAPI(title="kvevict", lifespan=_lifespan(engine, stop_engine_on_shutdown))
    if engine.settings.api_key:
        app.add_middleware(
            KeyGuard,
            key=api_keys(engine.settings),
            protect_metrics=engine.settings.protect_metrics,
            on_reject=lambda: engine.metrics.add("kvevict_requests_total", outcome="unauthorized"),
        )
    routes = Routes(engine)
    app.add_exception_handler(BadRequest, routes.bad_request)
    app.add_api_route("/health", routes.health, methods=["GET"])
    app.add_api_route("/metrics", routes.metrics, methods=["GET"])
    app.add_api_route("/v1/models", routes.models, methods=["GET"])
    app.add_api_route("/v1/chat/completions", routes.chat, methods=["POST"])
    app.add_api_route("/v1/completions", routes.completions, methods=["POST"])
    return app


def _lifespan(engine: Engine, stop_engine: bool):
    """The app's lifespan: nothing at startup; at shutdown, the engine stopped where asked."""

    @asynccontextmanager
    async def lifespan(app):
        yield
        if stop_engine:
            await asyncio.to_thread(engine.stop)

    return lifespan
