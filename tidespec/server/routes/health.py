"""``GET /health`` (200 while the engine loop runs, with online training's state) and ``GET /metrics``
(Prometheus): what a load balancer and a scraper poll."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from tidespec.server.api_errors import error_response
from tidespec.server.metrics import Metrics

if TYPE_CHECKING:
    from tidespec.online.serving.attach import OnlineTraining
    from tidespec.server.app import Server


def router(server: Server, metrics: Metrics, online: OnlineTraining | None) -> APIRouter:
    """The health and metrics routes of ``server``."""
    routes = APIRouter()

    @routes.get("/health")
    async def health() -> Response:
        if not server.aengine.running:
            return error_response(503, "engine loop is not running")
        if online is None:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "ok", "online": online.health()})

    @routes.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return routes
