"""The ``/dashboard`` page of ``tidespec serve``: live charts of what the server does, no Prometheus needed.

Why this exists: a self-improving server should be watchable without setting up Prometheus and
Grafana. The page (``static/dashboard.html``) polls ``GET /dashboard/data`` every 2 s and draws it
with uPlot 1.6.32, a 50 KB chart library vendored unchanged from its npm package ``uplot`` into
``static/`` (MIT, ``static/uPlot.LICENSE``; served from here: no CDN, the page works offline). The
numbers come from the server's ``Metrics`` (its ``series``: the same ``on_step`` /
``on_request_finished`` feeds as ``/metrics``), the policy's ``stats()`` and
``OnlineTraining.state()``, read when the page asks.

Routes (all behind the API key when the server has one; a browser gets a Basic-auth challenge for
them, so it shows its login prompt: any user name, the API key as password):

* ``GET /dashboard`` — the page;
* ``GET /dashboard/data?smooth=5`` — JSON: ``t`` (unix seconds, one per second of the last 10
  minutes) and aligned arrays: ``tokens_per_s`` {served, decoding, plain_estimate},
  ``acceptance`` {drafters, shadow, routes} (tokens per drafting step, rolling over ``smooth``
  seconds), ``gamma``, ``drafter_version``; ``buckets`` (per batch-size bucket: steps, gamma,
  drafter, the policy's ``gamma_b{N}``, speedup over plain decoding), ``server``, ``drafters``,
  ``policy``, ``online`` (``OnlineTraining.state()`` as is, or null);
* ``GET /dashboard/uPlot.iife.min.js``, ``GET /dashboard/uPlot.min.css`` — the chart library.

Example::

    tidespec serve --drafter suffix --policy analytic --port 8000
    # open http://127.0.0.1:8000/dashboard
    curl -s http://127.0.0.1:8000/dashboard/data | jq '.tokens_per_s.decoding[-1], .buckets'
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import time
from collections.abc import Awaitable, Callable
from importlib import resources
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter
from fastapi.responses import Response

from tidespec.engine.engine import LLMEngine
from tidespec.server.metrics import Metrics
from tidespec.speculative.api import Drafter

if TYPE_CHECKING:
    from tidespec.online.serving.attach import OnlineTraining

DASHBOARD_PATH = "/dashboard"
ASSETS = {"uPlot.iife.min.js": "text/javascript", "uPlot.min.css": "text/css"}
MAX_SMOOTH_S = 120


def basic_auth_password(encoded: bytes) -> bytes:
    """The password of an HTTP Basic ``Authorization`` value (after ``Basic ``); b"" if malformed.

    Example: ``basic_auth_password(base64.b64encode(b"me:sk-1"))`` -> ``b"sk-1"``."""
    try:
        decoded = base64.b64decode(encoded.strip(), validate=True)
    except (binascii.Error, ValueError):
        return b""
    _user, sep, password = decoded.partition(b":")
    return password if sep else b""


def _static(name: str) -> bytes:
    return (resources.files("tidespec.server") / "static" / name).read_bytes()


def _versions(drafter: Drafter | None) -> list[dict[str, Any]]:
    """Name and version (None when it has none) of each of the engine's drafters."""
    if drafter is None:
        return []
    return [{"name": name, "version": d.version if d.versioned else None} for name, d in drafter.members.items()]


def dashboard_data(engine: LLMEngine, model: str, metrics: Metrics, online: OnlineTraining | None,
                   smooth_s: int = 5) -> dict[str, Any]:
    """The JSON behind the page (see the module docstring)."""
    data = metrics.series.snapshot(smooth_s)
    policy = metrics.policy
    stats = policy.stats() if policy is not None else {}
    rows = {row["bucket"]: row for row in data["buckets"]}
    for name, value in stats.items():  # buckets the policy planned for but no decode step ran yet
        if name.startswith("gamma_b") and name[7:].isdigit() and int(name[7:]) not in rows:
            rows[int(name[7:])] = {"bucket": int(name[7:]), "steps": 0}
    names = engine.drafter_names
    for key, row in rows.items():
        row["policy_gamma"] = stats.get(f"gamma_b{key}")
        index = stats.get(f"drafter_b{key}")  # a controller choosing among several drafters
        if index is not None and 0 <= int(index) < len(names) and row["policy_gamma"]:
            row["policy_drafter"] = names[int(index)]
    data["buckets"] = [rows[k] for k in sorted(rows)]
    drafter = engine.drafter
    data["server"] = {"model": model, "time": time.time(), "drafter": drafter.name if drafter is not None else None,
                      "profile": metrics.profile is not None, "max_num_seqs": engine.config.cache.max_num_seqs}
    data["drafters"] = _versions(drafter)
    data["policy"] = {"name": policy.name, "stats": stats} if policy is not None else None
    data["online"] = online.state() if online is not None else None
    return data


def dashboard_router(engine: LLMEngine, model: str, metrics: Metrics, online: OnlineTraining | None = None) -> APIRouter:
    """The dashboard's routes (the API-key guard is the app's middleware)."""
    if engine.drafter is not None:
        metrics.series.default_drafter = engine.drafter.name
    page = _static("dashboard.html")
    assets = {name: (_static(name), media) for name, media in ASSETS.items()}
    no_store = {"Cache-Control": "no-store"}
    routes = APIRouter()

    @routes.get(DASHBOARD_PATH, include_in_schema=False)
    async def dashboard() -> Response:
        return Response(page, media_type="text/html; charset=utf-8", headers=no_store)

    @routes.get(f"{DASHBOARD_PATH}/data", include_in_schema=False)
    async def dashboard_json(smooth: int = 5) -> Response:
        body = dashboard_data(engine, model, metrics, online, min(max(smooth, 1), MAX_SMOOTH_S))
        return Response(json.dumps(_json_ready(body), allow_nan=False), media_type="application/json",
                        headers=no_store)

    for name, (content, media) in assets.items():
        routes.add_api_route(f"{DASHBOARD_PATH}/{name}", _asset_route(content, media), methods=["GET"],
                             include_in_schema=False)
    return routes


def _asset_route(content: bytes, media: str) -> Callable[[], Awaitable[Response]]:
    """A route answering one static file (a closure: no parameters a client could set)."""

    async def asset() -> Response:
        return Response(content, media_type=media, headers={"Cache-Control": "max-age=86400"})

    return asset


def _json_ready(obj: Any) -> Any:
    """``obj`` with non-finite floats as None (JSON has no NaN) and unknown objects as strings."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _json_ready(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_ready(v) for v in obj]
    if obj is None or isinstance(obj, (str, int)):
        return obj
    return str(obj)
