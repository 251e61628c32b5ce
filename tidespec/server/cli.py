"""``tidespec serve``: the OpenAI-compatible server from the command line.

Why this exists: engine flags come from the config dataclasses (``tidespec.speculative.registry.add_engine_args``)
so ``serve``, ``generate`` and ``bench`` share every flag and default; this module adds only the
HTTP ones. The server always runs with a bounded waiting queue: the engine flag ``--max-waiting``
defaults to ``DEFAULT_MAX_WAITING`` here, and 0 ("unbounded") is replaced by it.

Worked example::

    tidespec serve --drafter ngram --port 8000 --api-key secret
    TIDESPEC_API_KEY=secret tidespec serve --served-model-name smollm2 --max-waiting 32
    python -m tidespec.server.cli serve --port 8000        # same, without the top-level CLI
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from tidespec.commands import standalone_main
from tidespec.config import ConfigError, EngineConfig, finite_float
from tidespec.server.graceful import HEADER_TIMEOUT_S
from tidespec.speculative.registry import add_engine_args, check_config, engine_config_from_args
from tidespec.structured.tool_calls import REGISTRY as TOOL_PARSERS

if TYPE_CHECKING:
    from fastapi import FastAPI

    from tidespec.server.app import ServerConfig
    from tidespec.server.guard import Admission

DEFAULT_MAX_WAITING = 256
GRACE_S = 10.0  # seconds in-flight requests get to finish on SIGTERM before their streams are ended
BODY_TIMEOUT_S = 30.0
API_KEY_ENV = "TIDESPEC_API_KEY"

log = logging.getLogger("tidespec.server")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``serve`` sub-command to the ``tidespec`` CLI."""
    p = subparsers.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    add_engine_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000, help="TCP port (default: 8000)")
    add_api_args(g)
    g.add_argument("--header-timeout", type=finite_float, default=HEADER_TIMEOUT_S, metavar="S",
                   help="close a connection whose request headers are not complete S seconds after its "
                        f"first byte (408; default: {HEADER_TIMEOUT_S:g})")
    g.add_argument("--shutdown-grace", type=finite_float, default=GRACE_S, metavar="S",
                   help="on SIGTERM/SIGINT, admit nothing new (503) and give requests in flight S seconds to finish; "
                        f"the rest end with a 503 or an error event, then the server exits 0 (default: {GRACE_S:g})")
    g.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn and tidespec log level (default: info)")
    p.set_defaults(func=cmd_serve, max_waiting=DEFAULT_MAX_WAITING)


def add_api_args(g: argparse._ActionsContainer) -> None:
    """The flags of the API an app serves (``ServerConfig``): ``serve`` and ``fleet`` share them."""
    g.add_argument("--api-key", default=None,
                   help="require the key on every route but /health, sent as 'Authorization: Bearer KEY', "
                        f"'X-API-Key: KEY' or HTTP Basic auth with KEY as password (default: env {API_KEY_ENV})")
    g.add_argument("--served-model-name", default=None,
                   help="model name clients must send (default: the checkpoint's name)")
    g.add_argument("--body-timeout", type=finite_float, default=BODY_TIMEOUT_S, metavar="S",
                   help="answer 408 and close the connection when a request's body is not complete S seconds after "
                        f"its headers (default: {BODY_TIMEOUT_S:g})")
    g.add_argument("--trim-memory", action=argparse.BooleanOptionalAction, default=True,
                   help="after a request with a large body, hand the heap pages it freed back to the OS (glibc "
                        "malloc_trim, off the request path): RSS returns to its level before the burst (default: on)")
    g.add_argument("--strict-fields", action="store_true",
                   help="refuse requests with fields the server does not know (400); by default they are ignored, "
                        "named in the X-Tidespec-Ignored-Fields response header and logged")
    g.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template that replaces the model's (e.g. one that renders tools, for a model "
                        "whose own does not; the embedded model's renders them already)")
    g.add_argument("--tool-call-parser", default="auto", choices=["auto", *TOOL_PARSERS],
                   help="how the model writes tool calls: hermes (<tool_call>: Qwen2.5/3, SmolLM2), llama3_json, "
                        "mistral ([TOOL_CALLS]); auto: the one the chat template writes (default: auto)")
    g.add_argument("--exactness-check", type=finite_float, default=0.0, metavar="RATE",
                   help="re-decode this fraction of finished greedy requests plainly while the engine is idle and "
                        "compare them token by token; a mismatch is logged (request id, position, top-2 logit gap) "
                        "and counted in tidespec:exactness_checks_total{result} (default: 0, off)")


def server_config_from_args(ns: argparse.Namespace, config: EngineConfig) -> ServerConfig:
    """The ``ServerConfig`` of ``add_api_args``' flags (the API key from the flag, else the environment)."""
    from tidespec.server.app import ServerConfig

    api_key = ns.api_key if ns.api_key is not None else os.environ.get(API_KEY_ENV) or None
    template = None
    if ns.chat_template is not None:
        try:
            template = Path(ns.chat_template).expanduser().read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"--chat-template {ns.chat_template}: cannot be read ({exc.__class__.__name__})") from None
    return ServerConfig(served_model_name=ns.served_model_name or served_name(config), api_key=api_key,
                        exactness_check=ns.exactness_check, body_timeout_s=ns.body_timeout,
                        strict_fields=ns.strict_fields, trim_memory=ns.trim_memory, chat_template=template,
                        tool_call_parser=ns.tool_call_parser)


def warn_if_exposed(host: str, api_key: str | None) -> None:
    """One warning line when ``host`` is reachable from other machines (and more so without a key)."""
    if not _is_loopback(host):
        log.warning("binding %s: the server is reachable from other machines%s", host,
                    "" if api_key else " and has no API key")


def served_name(config: EngineConfig) -> str:
    """The default served model name: the checkpoint's file/dir name, or the embedded model's."""
    if config.model.model:
        return Path(config.model.model.rstrip("/")).name.removesuffix(".gguf") or "tidespec"
    from tidespec.models.loading.loader import EMBEDDED_GGUF_NAME
    return EMBEDDED_GGUF_NAME.split(".")[0]


def server_engine_config(ns: argparse.Namespace) -> EngineConfig:
    """The engine config of ``serve``: the waiting queue is always bounded."""
    config = engine_config_from_args(ns)
    check_config(config)  # an unknown drafter is refused before the port is bound and the model loads
    if config.scheduler.max_waiting == 0:
        config.scheduler = dataclasses.replace(config.scheduler, max_waiting=DEFAULT_MAX_WAITING)
    return config


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def cmd_serve(ns: argparse.Namespace) -> int:
    import uvicorn

    from tidespec.server.graceful import GracefulServer
    from tidespec.server.guard import Admission
    from tidespec.server.loading import DeferredApp

    if not 0 < ns.port < 65536:
        raise ConfigError(f"port must be in [1, 65535], got {ns.port}")
    if not ns.header_timeout > 0:  # --body-timeout is checked by ServerConfig
        raise ConfigError(f"--header-timeout must be > 0, got {ns.header_timeout}")
    if not ns.shutdown_grace >= 0:
        raise ConfigError(f"--shutdown-grace must be >= 0, got {ns.shutdown_grace}")
    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = server_engine_config(ns)
    server_config = server_config_from_args(ns, config)
    warn_if_exposed(ns.host, server_config.api_key)
    admission = Admission("loading")
    closers: list[Callable[[], None]] = []
    # the port is bound first: /health answers 503 "loading" while the model loads (server/loading.py)
    app = DeferredApp(lambda: _load_app(config, server_config, admission, closers), admission,
                      on_failure=lambda _exc: setattr(server, "should_exit", True))
    server = GracefulServer(uvicorn.Config(app, host=ns.host, port=ns.port, log_level=ns.log_level,
                                           timeout_graceful_shutdown=5), grace_s=ns.shutdown_grace,
                            header_timeout_s=ns.header_timeout)
    log.info("listening on http://%s:%d; loading the model", ns.host, ns.port)
    try:
        # SIGTERM: admit nothing new, requests in flight get the grace to finish, the rest end
        # with an error event; then exit 0
        server.run()
    finally:
        for close in closers:
            close()
    if app.error is not None:
        raise app.error
    return 0


def _load_app(config: EngineConfig, server_config: ServerConfig, admission: Admission,
              closers: list[Callable[[], None]]) -> FastAPI:
    """The engine, its online training if asked, and the app serving them (on the loading thread)."""
    from tidespec.llm import build_engine
    from tidespec.server.app import create_app
    from tidespec.threads import release_team

    engine = build_engine(config)
    online = None
    if config.online.enabled:
        from tidespec.online.serving.attach import OnlineConfig, attach_online_training
        from tidespec.online.serving.governor import GovernorConfig
        from tidespec.online.serving.launch import restart_policy, trainer_log_path, trainer_starter

        oc = config.online
        online = attach_online_training(engine, OnlineConfig.from_engine_config(config))
        closers.append(online.close)
        # a trainer that dies is restarted with backoff; its state is in /health and /metrics
        # on the engine's own device the trainer yields to serving (paused while requests run)
        shared = (oc.trainer_device or config.model.device) == config.model.device
        online.supervise_trainer(trainer_starter(config, online.config), restart_policy(config),
                                 trainer_log_path(online.config),
                                 yield_to=GovernorConfig(share=oc.trainer_share) if shared else None)
    app = create_app(engine, server_config, on_shutdown=online.close if online is not None else None, online=online,
                     admission=admission)
    log.info("serving %r (drafter %s, policy %s, max_waiting %d%s); live dashboard at /dashboard",
             server_config.served_model_name, config.spec.drafter, config.policy.name,
             config.scheduler.max_waiting, ", online training" if online is not None else "")
    # the engine steps on a thread of its own: the OpenMP team this thread made while loading the
    # model would otherwise keep that thread's team from spin-waiting (tidespec.threads)
    release_team()
    return app


def main(argv: list[str] | None = None) -> int:
    return standalone_main(register, argv)


if __name__ == "__main__":
    sys.exit(main())
