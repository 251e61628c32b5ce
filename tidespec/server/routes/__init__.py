"""The HTTP routes of ``tidespec serve``, one ``APIRouter`` module per concern.

Why this exists: a route used to mean editing the 107-line ``create_app``, whose routes were closures
in it, while the dashboard registered its own another way. Each concern now builds its router from
the objects it needs (``router(...) -> APIRouter``: no module-level state) and ``create_app`` only
includes them. A new route is one module here plus its test; its request handling goes on
``server.app.Server`` when other routes share it.

* ``health``: ``GET /health``, ``GET /metrics``;
* ``models``: ``GET /v1/models``, ``GET /v1/models/{model_id}``;
* ``completions``: ``POST /v1/completions``;
* ``chat``: ``POST /v1/chat/completions``;
* the dashboard's page, data and assets: ``server.dashboard.dashboard_router``.

Example::

    app.include_router(completions.router(server))   # what create_app does for each
"""
