"""``tidespec bench fleet``: its arithmetic (rolling acceptance, requests to a level, the trace) and
its settings. A run of both configurations needs Ray: ``tests/fleet/test_fleet_bench.py``."""

from __future__ import annotations

import pytest

from tidespec.bench.fleet.run import (
    FleetBenchConfig,
    Request,
    Run,
    requests_to_reach,
    rolling_acceptance,
    summarize,
    trace_items,
)
from tidespec.config import ConfigError


def _req(draft: int, acc: int, t: float = 0.0) -> Request:
    return Request(client=0, index=0, prompt_id="p", done_s=t, draft_tokens=draft, accepted_tokens=acc)


def test_rolling_acceptance_and_requests_to_a_level() -> None:
    curve = rolling_acceptance([_req(4, 2), _req(4, 4), _req(4, 0)], replicas=2, window=1)
    assert curve == [(0.5, 0.5), (1.0, 0.75), (1.5, 0.5)]
    assert rolling_acceptance([_req(0, 0)], 2, 4) == [(0.5, 0.0)]  # nothing drafted: 0, not a division by 0
    assert requests_to_reach([(1, 0.2), (2, 0.5), (3, 0.7)], 0.6, 1) == 3
    assert requests_to_reach([(1, 0.9), (2, 0.5)], 0.6, 2) is None  # before the window is full it does not count


def test_summary_level_defaults_to_90_percent_of_the_best_last_quarter() -> None:
    cfg = FleetBenchConfig(window=1, requests_per_replica=4)
    fast = Run("fleet", [_req(4, a, t) for t, a in enumerate([0, 4, 4, 4, 4, 4, 4, 4])])
    slow = Run("independent", [_req(4, a, t) for t, a in enumerate([0, 0, 0, 0, 0, 4, 4, 4])])
    s = summarize([fast, slow], cfg)
    assert s["level"] == pytest.approx(0.9)
    # window 1 x 2 replicas: the last 2 requests; the fleet's reach 8/8 after its 3rd, independent's after its 7th
    assert s["configs"]["fleet"]["requests_per_replica_to_level"] == 1.5
    assert s["configs"]["independent"]["requests_per_replica_to_level"] == 3.5
    assert s["configs"]["independent"]["acceptance_first_quarter"] == 0.0


def test_trace_gives_each_client_its_own_records_in_turn() -> None:
    cfg = FleetBenchConfig(workload="code_unseen", replicas=2, requests_per_replica=4)
    a, b = trace_items(cfg)
    assert [r.id for r in a] != [r.id for r in b] and len(a) == len(b) == 4
    assert not {r.id for r in a} & {r.id for r in b}


@pytest.mark.parametrize("kw", [{"configs": "fleet,bogus"}, {"replicas": 1}, {"target": 1.5},
                                {"engine_args": "--drafter 'eagle3"}])
def test_bad_settings_are_refused(kw: dict) -> None:
    with pytest.raises(ConfigError):
        FleetBenchConfig(**kw)
