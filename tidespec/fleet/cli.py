"""``tidespec fleet``: N serving replicas and one trainer on Ray, behind one OpenAI-compatible ingress.

Why this exists: the command line of ``fleet.deployments``. Engine flags come from the config
dataclasses exactly as for ``serve`` (``--online-training`` gives the fleet its one trainer), the
API flags are ``serve``'s (``server.cli.add_api_args``), the fleet's own from ``FleetConfig``.
Ray is imported only when the command runs; without it the command says how to install it.

Worked example::

    tidespec fleet --replicas 2 --threads 1 --drafter suffix,eagle3 --policy analytic --eagle3-dir /shared/drafter \\
        --online-training --port 8000
    # on a cluster: `ray start --head` here, `ray start --address HEAD:6379` on the others, then
    tidespec fleet --ray-address auto --replicas 8 --eagle3-dir /nfs/drafter --online-training ...
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import sys
import threading
from types import FrameType

from tidespec.commands import standalone_main
from tidespec.config import ConfigError, EngineConfig
from tidespec.errors import UserError
from tidespec.flags import add_dataclass_args, dataclass_from_args
from tidespec.fleet.config import FleetConfig, shared_dirs
from tidespec.server.cli import add_api_args, server_config_from_args, server_engine_config, warn_if_exposed
from tidespec.speculative.policy.factory import check_policy_drafters

log = logging.getLogger("tidespec.fleet")
INSTALL_HINT = "pip install 'tidespec[fleet]' (or `make fleet`)"


class FleetUnavailableError(UserError):
    """Ray (the ``fleet`` extra) is not installed."""


class FleetStartError(UserError):
    """Ray Serve could not deploy the fleet (a replica or the trainer failed to start)."""


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``fleet`` sub-command to the ``tidespec`` CLI."""
    from tidespec.speculative.registry import add_engine_args

    p = subparsers.add_parser("fleet", help="serve with N replicas and one trainer on Ray (needs the fleet extra)")
    add_engine_args(p)
    add_dataclass_args(p, FleetConfig)
    g = p.add_argument_group("ingress")
    g.add_argument("--host", default="127.0.0.1", help="address Ray Serve's HTTP proxy binds (default: 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000, help="TCP port of the ingress (default: 8000)")
    add_api_args(g)
    g.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="tidespec log level (default: info)")
    p.set_defaults(func=cmd_fleet)


def cmd_fleet(ns: argparse.Namespace) -> int:
    if not 0 < ns.port < 65536:
        raise ConfigError(f"port must be in [1, 65535], got {ns.port}")
    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = shared_dirs(server_engine_config(ns))
    # what the replicas would refuse, refused here in one line, before Ray starts
    check_policy_drafters(config.policy.name, config.spec.drafter_names)
    server_config = server_config_from_args(ns, config)
    fleet = dataclass_from_args(FleetConfig, ns)
    try:
        import ray
        from ray import serve

        from tidespec.fleet.deployments import APP_NAME, fleet_application
    except ImportError as exc:
        raise FleetUnavailableError(f"tidespec fleet needs Ray ({exc}): {INSTALL_HINT}") from None
    warn_if_exposed(ns.host, server_config.api_key)
    stop = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        log.info("%s: shutting the fleet down", signal.Signals(signum).name)
        stop.set()

    ray.init(address=fleet.ray_address, num_cpus=local_cpus(fleet, config) if fleet.ray_address is None else None,
             include_dashboard=False, logging_level=ns.log_level.upper())
    for sig in (signal.SIGINT, signal.SIGTERM):  # after ray.init, which sets handlers of its own
        signal.signal(sig, on_signal)
    try:
        serve.start(http_options={"host": ns.host, "port": ns.port})
        log.info("starting %d replica(s)%s; the ingress will be http://%s:%d", fleet.replicas,
                 " and the trainer" if config.online.enabled else "", ns.host, ns.port)
        try:
            serve.run(fleet_application(config, server_config, fleet), name=APP_NAME, route_prefix="/")
        except RuntimeError as exc:  # a replica or the trainer could not be built: the cause is logged above
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise FleetStartError(f"the fleet did not start ({first}); the replicas' errors are in the log "
                                  "above and under /tmp/ray/session_latest/logs/serve/") from None
        log.info("fleet serving %r on http://%s:%d (%d replicas%s)", server_config.served_model_name, ns.host,
                 ns.port, fleet.replicas, ", one trainer" if config.online.enabled else "")
        while not stop.wait(1.0):
            pass
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0


def local_cpus(fleet: FleetConfig, config: EngineConfig) -> int:
    """The logical CPUs of a local Ray cluster: the cores, or what the replicas and the trainer
    reserve when that is more (Ray would otherwise leave a replica unscheduled for ever; the
    processes then share the cores, as ``serve`` and its trainer child do)."""
    need = fleet.replicas * fleet.replica_cpus + (fleet.trainer_cpus if config.online.enabled else 0)
    cores = os.cpu_count() or 1
    if need > cores:
        log.info("a local Ray cluster of %d logical CPUs on %d cores: the replicas and the trainer share them",
                 math.ceil(need), cores)
    return max(cores, math.ceil(need))


def main(argv: list[str] | None = None) -> int:
    return standalone_main(register, argv)


if __name__ == "__main__":
    sys.exit(main())
