"""``GET /v1/models`` and ``GET /v1/models/{model_id}``: the one served model, as the OpenAI client's
``models.list`` and ``models.retrieve`` expect it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import APIRouter

from tidespec.server.protocol import ErrorResponse, ModelCard, ModelList

if TYPE_CHECKING:
    from tidespec.server.app import Server


def router(server: Server) -> APIRouter:
    """The model routes of ``server``."""
    routes = APIRouter()

    def card() -> ModelCard:
        return ModelCard(id=server.config.served_model_name, created=server.created,
                         max_model_len=server.engine.max_model_len)

    @routes.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        return ModelList(data=[card()])

    @routes.get("/v1/models/{model_id:path}", response_model=ModelCard, responses={404: {"model": ErrorResponse}})
    async def model(model_id: str) -> ModelCard:
        """The OpenAI client's ``models.retrieve``; model ids may contain ``/`` (HF names)."""
        server.check_model(model_id)
        return card()

    return routes
