"""The Ray Serve application of a fleet: ``FleetReplica`` x N behind one ingress, one ``FleetTrainer``.

Why this exists: this is the only module that imports Ray. Each replica is a whole tidespec
server (``server.app.create_app`` over its own engine: the same routes, errors and streaming as
``tidespec serve``), reached through Ray Serve's HTTP proxy, which routes each request to a
replica. With ``--online-training`` every replica captures signals into the one shared signal
store and polls the one shared publish root (``online.serving.attach``, without a trainer child of
its own), and the ``FleetTrainer`` deployment runs the one trainer child over them
(``online.serving.launch``, restarted with backoff by its ``TrainerSupervisor``). The store's
manifest lock and per-process sequence-id salts let many replicas append to one store; a
version is published atomically (a directory renamed into place, then ``LATEST``), so no replica
ever loads a half-written one. Ray Serve restarts a replica or the trainer whose actor dies or
whose ``check_health`` raises; a replica keeps serving its last good version whatever the trainer
does.

Worked example (what ``tidespec fleet`` does)::

    ray.init()
    serve.start(http_options={"host": "127.0.0.1", "port": 8000})
    serve.run(fleet_application(engine_config, server_config, FleetConfig(replicas=2)), name="tidespec")
    # POST http://127.0.0.1:8000/v1/completions -> one of the replicas; the response carries
    # X-Tidespec-Replica: <replica id> and, with online training, its "drafter_version"
"""

from __future__ import annotations

import logging
import os
from typing import Any

from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tidespec.config import EngineConfig
from tidespec.fleet.config import FleetConfig
from tidespec.server.app import ServerConfig

logger = logging.getLogger("tidespec.fleet")

APP_NAME = "tidespec"
REPLICA_HEADER = "x-tidespec-replica"
CONSTRUCTOR_RETRIES = 3  # a replica that cannot be built (bad model path on a node) fails the start in minutes


class ReplicaHeader:
    """ASGI middleware: every HTTP response names the replica that made it (``X-Tidespec-Replica``),
    so a client, a log or a test can tell the replicas behind the one ingress apart."""

    def __init__(self, app: ASGIApp, replica: str) -> None:
        self.app = app
        self.replica = replica

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_named(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message).append(REPLICA_HEADER, self.replica)
            await send(message)

        await self.app(scope, receive, send_named)


@serve.ingress()
class FleetReplica:
    """One serving replica: an engine (with online capture and drafter swaps when training is on)
    and the tidespec FastAPI app over it, built in the replica's process when Ray starts it."""

    def __init__(self, config: EngineConfig, server_config: ServerConfig,
                 trainer: DeploymentHandle | None = None) -> None:
        from tidespec.llm import build_engine
        from tidespec.server.app import create_app
        from tidespec.threads import release_team

        self.replica = serve.get_replica_context().replica_id.unique_id
        engine = build_engine(config)
        online = None
        if config.online.enabled:
            from tidespec.online.serving.attach import OnlineConfig, attach_online_training

            # no trainer child here: the fleet's one trainer reads every replica's signals
            online = attach_online_training(engine, OnlineConfig.from_engine_config(config))
        app = create_app(engine, server_config, online=online, on_shutdown=online.close if online is not None else None)
        app.add_middleware(ReplicaHeader, replica=self.replica)
        self._app = app
        self._engine_started = False
        self._trainer = trainer  # the handle keeps the trainer deployment in this application
        logger.info("replica %s (pid %d) serving %r%s", self.replica, os.getpid(), server_config.served_model_name,
                    ", online capture into the shared store" if online is not None else "")
        release_team()  # the engine steps on a thread of its own (tidespec.threads)

    def __serve_build_asgi_app__(self) -> ASGIApp:
        return self._app

    def check_health(self) -> None:
        """Ray Serve's periodic check: a replica whose engine loop stopped is replaced."""
        running = self._app.state.async_engine.running
        self._engine_started = self._engine_started or running
        if self._engine_started and not running:
            raise RuntimeError(f"replica {self.replica}: the engine loop is not running")


@serve.deployment(num_replicas=1)
class FleetTrainer:
    """The fleet's one trainer: ``train-drafter`` as a supervised child process over the shared
    signal store and publish root (restarted with backoff; when its supervisor gives up, the
    health check fails and Ray Serve starts a new ``FleetTrainer``)."""

    def __init__(self, config: EngineConfig) -> None:
        from tidespec.online.serving.attach import OnlineConfig
        from tidespec.online.serving.launch import restart_policy, trainer_log_path, trainer_starter
        from tidespec.online.serving.supervisor import TrainerSupervisor

        online = OnlineConfig.from_engine_config(config)
        self.supervisor = TrainerSupervisor(trainer_starter(config, online), restart_policy(config),
                                            log_path=trainer_log_path(online))
        self.supervisor.start()
        logger.info("fleet trainer (pid %d) watching %s, publishing to %s; its log: %s", os.getpid(),
                    online.signal_dir, online.publish_root, trainer_log_path(online))

    def state(self) -> dict[str, Any]:
        """The trainer child's supervisor state (``TrainerSupervisor.state``)."""
        return self.supervisor.state()

    def check_health(self) -> None:
        if self.supervisor.state()["state"] == "failed":
            raise RuntimeError("the fleet trainer's child keeps dying; Ray Serve restarts the trainer")

    def __del__(self) -> None:
        self.supervisor.close()


def fleet_application(config: EngineConfig, server_config: ServerConfig, fleet: FleetConfig) -> serve.Application:
    """The Ray Serve application: ``fleet.replicas`` replicas of ``FleetReplica`` (the ingress) and,
    with online training, one ``FleetTrainer``. ``config`` names shared directories
    (``fleet.config.shared_dirs``)."""
    actor = {"num_cpus": fleet.replica_cpus, "num_gpus": fleet.replica_gpus}
    replica = serve.deployment(FleetReplica, name="FleetReplica", num_replicas=fleet.replicas,
                               ray_actor_options=actor, health_check_period_s=fleet.health_check_s,
                               max_ongoing_requests=config.cache.max_num_seqs + config.scheduler.max_waiting,
                               max_constructor_retry_count=CONSTRUCTOR_RETRIES)
    trainer = None
    if config.online.enabled:
        trainer = FleetTrainer.options(ray_actor_options={"num_cpus": fleet.trainer_cpus},
                                       health_check_period_s=fleet.health_check_s,
                                       max_constructor_retry_count=CONSTRUCTOR_RETRIES).bind(config)
    return replica.bind(config, server_config, trainer)
