"""``tidespec fleet`` without Ray: its config, its shared directories, its flags, and a clear error.

These run in ``make test`` (whose set-up does not install Ray); the fleet itself runs on a local
Ray cluster in ``test_fleet.py`` (``make test-fleet``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tidespec.cli import main
from tidespec.config import ConfigError, EngineConfig, OnlineTrainingConfig, SpecConfig
from tidespec.fleet.cli import local_cpus
from tidespec.fleet.config import FleetConfig, shared_dirs
from tidespec.speculative.drafters.eagle3_options import Eagle3Options, eagle3_options


@pytest.mark.parametrize("kw", [{"replicas": 0}, {"replica_cpus": 0.0}, {"trainer_cpus": -1.0},
                                {"replica_gpus": -0.5}, {"health_check_s": 0.0}])
def test_fleet_config_refuses_what_cannot_run(kw: dict) -> None:
    with pytest.raises(ConfigError):
        FleetConfig(**kw)


def test_shared_dirs_are_absolute_and_the_store_defaults_under_the_publish_root(tmp_path: Path,
                                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    shared = shared_dirs(_online_config("drafter", None))
    assert eagle3_options(shared.spec).dir == str(tmp_path / "drafter")
    assert shared.online.signal_dir == str(tmp_path / "drafter" / "signals")
    other = shared_dirs(_online_config("drafter", "sig"))
    assert other.online.signal_dir == str(tmp_path / "sig")
    assert shared_dirs(EngineConfig()) == EngineConfig()  # no publish root: nothing to share


def _online_config(root: str, signals: str | None) -> EngineConfig:
    return EngineConfig(spec=SpecConfig(drafter="eagle3", options={"eagle3": Eagle3Options(dir=root)}),
                        online=OnlineTrainingConfig(enabled=True, signal_dir=signals))


def test_a_local_cluster_has_the_cpus_its_replicas_and_trainer_reserve() -> None:
    cores = os.cpu_count() or 1
    big = FleetConfig(replicas=cores + 3, replica_cpus=1.0, trainer_cpus=2.0)
    assert local_cpus(big, _online_config("/d", None)) == cores + 5
    assert local_cpus(big, EngineConfig()) == cores + 3  # no trainer without --online-training
    assert local_cpus(FleetConfig(replicas=1, replica_cpus=0.5), EngineConfig()) == cores


def test_fleet_without_ray_is_one_clear_line(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    assert main(["fleet", "--replicas", "2", "--drafter", "ngram"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: tidespec fleet needs Ray") and "tidespec[fleet]" in err and "\n" not in err


def test_bad_fleet_flags_are_refused_before_ray_starts(monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fleet", "--replicas", "0"]) == 2
    assert "replicas must be >= 1" in capsys.readouterr().err
    # what every replica would refuse while Ray retries it: one line, before Ray is even imported
    monkeypatch.setitem(sys.modules, "ray", None)
    assert main(["fleet", "--drafter", "suffix,eagle3", "--eagle3-dir", "d", "--online-training"]) == 2
    assert "use --policy analytic" in capsys.readouterr().err


def test_the_single_process_server_never_imports_ray() -> None:
    code = ("import sys, tidespec.cli, tidespec.server.app, tidespec.server.cli, tidespec.fleet.cli; "
            "tidespec.cli.build_parser(); print('ray' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"
