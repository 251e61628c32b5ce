"""``FleetConfig``: how many replicas, which Ray cluster, what each replica and the trainer reserve.

Why this exists: ``tidespec fleet`` adds these settings to the engine's and the API's (which it
shares with ``serve``); the CLI is built from this dataclass like every other config, and it is
checked on construction, before Ray starts or a model loads.

Worked example::

    FleetConfig(replicas=2, replica_cpus=1, trainer_cpus=1)       # a local Ray cluster of 3 CPUs' worth
    FleetConfig(replicas=8, ray_address="auto")                   # join the cluster `ray start` made
    shared_dirs(config)  # --eagle3-dir and --signal-dir as absolute paths, the same on every node
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from tidespec.config import EngineConfig, opt
from tidespec.errors import ConfigError
from tidespec.speculative.drafters.eagle3_options import eagle3_options, with_eagle3


@dataclass
class FleetConfig:
    """The fleet's own settings (the engine's and the API's come from their own configs)."""

    replicas: int = opt(2, "serving replicas, each a whole engine behind the one ingress (Ray Serve replicas)")
    ray_address: str | None = opt(None, "Ray cluster to join, e.g. 'auto' (the one `ray start` made on this node) "
                                        "or ray://HEAD:10001 (default: start a local cluster)")
    replica_cpus: float = opt(1.0, "CPUs Ray reserves for each replica (set --threads to match)")
    trainer_cpus: float = opt(1.0, "CPUs Ray reserves for the trainer (with --online-training)")
    replica_gpus: float = opt(0.0, "GPUs Ray reserves for each replica (--device cuda needs 1)")
    health_check_s: float = opt(10.0, "seconds between Ray Serve's health checks of each replica and the trainer; "
                                      "one that fails is replaced")

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ConfigError(f"replicas must be >= 1, got {self.replicas}")
        if self.replica_cpus <= 0 or self.trainer_cpus <= 0:
            raise ConfigError(f"replica_cpus and trainer_cpus must be > 0, got {self.replica_cpus} and "
                              f"{self.trainer_cpus}")
        if self.replica_gpus < 0:
            raise ConfigError(f"replica_gpus must be >= 0, got {self.replica_gpus}")
        if self.health_check_s <= 0:
            raise ConfigError(f"health_check_s must be > 0, got {self.health_check_s}")


def shared_dirs(config: EngineConfig) -> EngineConfig:
    """``config`` with the publish root (``--eagle3-dir``) and the signal store (``--signal-dir``,
    default ``<eagle3-dir>/signals``) as absolute paths: every replica and the trainer must name
    the same directories, wherever Ray places them (on several nodes: a shared filesystem mounted
    at that path on each)."""
    root = eagle3_options(config.spec).dir
    if not root:
        return config
    root = str(Path(root).expanduser().resolve())
    signals = config.online.signal_dir
    signals = str(Path(signals).expanduser().resolve()) if signals else str(Path(root) / "signals")
    spec = with_eagle3(config.spec, dir=root)
    online = dataclasses.replace(config.online, signal_dir=signals)
    return dataclasses.replace(config, spec=spec, online=online)
