"""The /dashboard page: its time series hand-traced, its data on a live server, its
API-key guard, and the page drawn by a headless Chromium.

The live tests run the tiny model with the n-gram and suffix drafters, chosen per step by the
analytic policy on a profile measured for that model here (a fraction of a second), so the
plain-decoding line is a real estimate. The browser test is skipped when no Chromium binary is on
PATH (``make test`` installs ``chromium-headless-shell`` where it can); with
``TIDESPEC_SCREENSHOT=1`` it sends traffic for longer and writes ``docs/dashboard.png``.
"""

from __future__ import annotations

import base64
import os
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import tiny_llama, tiny_tokenizer
from tests.server.live import CHAT_TEMPLATE, MODEL, LiveServer, tiny_engine
from tidespec.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from tidespec.engine.engine import LLMEngine
from tidespec.llm import build_drafter
from tidespec.server.app import ServerConfig, create_app
from tidespec.server.dashboard import basic_auth_password
from tidespec.server.metrics import Metrics
from tidespec.server.series import Series
from tidespec.speculative.drafters.multi import MultiDrafter
from tidespec.speculative.policy.factory import PolicyOptions, make_policy
from tidespec.speculative.policy.profiler import ProfilerConfig, measure_profile
from tidespec.speculative.policy.speedup import Profile
from tidespec.stats import RequestStats, StepStats

BROWSERS = ("chromium-headless-shell", "chromium", "chromium-browser", "google-chrome", "chrome-headless-shell")
SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "dashboard.png"
# a repetitive prompt (the n-gram drafter finds its continuations) and a less repetitive one
PROMPTS = {"code": " ".join(["t5 t6 t7"] * 6), "chat": "t9 t4 t11 t20 t3 t8 t30 t12 t5"}


# ----------------------------------------------------------------------------- the series, hand-traced
class _Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_series_hand_traced() -> None:
    """The module docstring's example: two decode steps at batch 2 in second 100."""
    clock = _Clock(100.2)
    s = Series(clock=clock)
    s.profile = Profile(target_latency={2: 0.4}, draft_cost={"default": 0.0})  # baseline_tokens_per_s(2) = 5
    step = dict(num_decode_seqs=2, batch_size=2, num_emitted_tokens=4, total_time=0.5, spec_lens={0: 3, 1: 3},
                num_drafts=2, num_draft_tokens=6, num_accepted_tokens=1, seq_outcomes=[(3, 3, 1), (3, 3, 0)],
                seq_drafters={0: "ngram", 1: "ngram"})
    s.on_step(StepStats(**step))
    s.on_step(StepStats(**step))
    s.on_step(StepStats(num_prefill_tokens=9, num_emitted_tokens=1))  # a prefill step: served, not decoding
    s.on_request_finished("code", RequestStats(num_drafts=4, num_accepted_tokens=2), 9)
    assert s.snapshot()["t"] == []  # second 100 is not over yet
    clock.t = 101.5
    d = s.snapshot(smooth_s=1)
    assert d["t"] == [100]
    assert d["tokens_per_s"] == {"served": [9.0], "decoding": [8.0], "plain_estimate": [5.0]}
    assert d["acceptance"]["drafters"] == {"ngram": [1.5]}
    assert d["acceptance"]["routes"] == {"code": [1.5]}
    assert d["gamma"] == [3.0]
    assert d["requests"] == {"code": 1}
    assert d["buckets"] == [{"bucket": 2, "steps": 2, "mean_batch": 2.0, "last_gamma": 3, "mean_gamma": 3.0,
                             "last_drafter": "ngram", "drafter_share": {"ngram": 1.0}, "speedup_vs_plain": 1.6}]
    # idle seconds count as 0 tokens/s and no acceptance; the rolling window spans them
    clock.t = 104.0
    d = s.snapshot(smooth_s=2)
    assert d["t"] == [100, 101, 102, 103]
    assert d["tokens_per_s"]["served"] == [9.0, 4.5, 0.0, 0.0]
    assert d["acceptance"]["drafters"]["ngram"] == [1.5, 1.5, None, None]


def test_series_per_drafter_outcomes_and_bounded_ring() -> None:
    """Steps that say which drafter drafted what are split by drafter; the ring keeps ``window_s`` s."""
    clock = _Clock(0.0)
    s = Series(window_s=5, clock=clock)
    s.default_drafter = "eagle3"
    for sec in range(20):
        clock.t = float(sec)
        st = StepStats(num_decode_seqs=3, num_emitted_tokens=5, total_time=0.1, spec_lens={0: 2, 1: 2, 2: 2},
                       num_drafts=3, num_accepted_tokens=3)
        st.drafter_outcomes = {"suffix": [(2, 2, 2), (2, 2, 1)], "eagle3": [(2, 2, 0)]}  # type: ignore[attr-defined]
        s.on_step(st)
        s.on_step(StepStats(num_decode_seqs=1, num_emitted_tokens=1, total_time=0.1, num_drafts=1,
                            spec_lens={0: 1}))  # no per-drafter outcomes: the engine's drafter
    assert len(s._points) == 5  # 14..18 closed, 19 open
    clock.t = 20.0
    d = s.snapshot(smooth_s=1)
    assert d["t"] == [15, 16, 17, 18, 19]
    assert d["acceptance"]["drafters"] == {"suffix": [2.5] * 5, "eagle3": [1.0] * 5}
    assert d["tokens_per_s"]["plain_estimate"] is None
    rows = {r["bucket"]: r for r in d["buckets"]}
    assert rows[4]["drafter_share"] == {"eagle3": 0.333, "suffix": 0.667} and rows[4]["last_drafter"] == "suffix"
    assert rows[1]["last_drafter"] == "eagle3"


def test_metrics_feed_the_series() -> None:
    """One data source: ``Metrics.on_step_end`` / ``on_request_finished`` fill ``Metrics.series``."""
    m = Metrics()
    m.on_step_end(StepStats(num_decode_seqs=1, num_emitted_tokens=3, total_time=0.1, num_drafts=1,
                        num_draft_tokens=2, num_accepted_tokens=2, spec_lens={0: 2}))
    assert m.series._open is not None and m.series._open.emitted == 3
    assert m.series._open.drafters == {"drafter": [1, 2]}


def test_basic_auth_password() -> None:
    assert basic_auth_password(base64.b64encode(b"me:sk-1:x")) == b"sk-1:x"
    assert basic_auth_password(base64.b64encode(b"no-colon")) == b""
    assert basic_auth_password(b"%%%") == b""


# ----------------------------------------------------------------------------- live
def _engine() -> LLMEngine:
    tok = tiny_tokenizer(64)
    tok.chat_template = CHAT_TEMPLATE
    model = tiny_llama(64)
    spec = SpecConfig(drafter="ngram,suffix", num_speculative_tokens=3)
    drafter = build_drafter(spec, model, 8, 160)  # two drafters, both scored on the side
    assert isinstance(drafter, MultiDrafter)
    profile = measure_profile(model, drafter, ProfilerConfig(
        batch_sizes=(1, 2, 4, 8), tokens_per_seq=(1, 2, 4), single_seq_tokens=(1, 2, 4, 8, 16, 32),
        catchup_tokens=(1,), catchup_batches=(1,), context=64, passes=1, target_s=0.05))
    cfg = EngineConfig(cache=CacheConfig(max_model_len=160, max_num_seqs=8), scheduler=SchedulerConfig(max_waiting=64),
                       spec=spec)
    policy = make_policy("analytic", PolicyOptions(gamma_max=3, profile=profile, drafters=tuple(drafter.members),
                                                   shadowed=drafter.shadowed))
    return LLMEngine(model, tok, cfg, drafter=drafter, policy=policy)


def _traffic(url: str, seconds: float, clients: int = 1, headers: dict[str, str] | None = None) -> None:
    """Completions from ``clients`` threads for ``seconds`` (at least one round each), both routes."""
    deadline = time.monotonic() + seconds

    def client(k: int) -> None:
        with httpx.Client(base_url=url, timeout=60, headers=headers) as c:
            i = k
            while True:
                route = ("code", "chat")[i % 2]
                body = {"model": MODEL, "prompt": PROMPTS[route], "max_tokens": 24 + 8 * (i % 3), "temperature": 0,
                        "ignore_eos": True}
                r = c.post("/v1/completions", json=body, headers={"X-Tidespec-Route": route})
                assert r.status_code == 200, r.text
                i += 1
                if i - k >= 2 and time.monotonic() > deadline:
                    return

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _by_drafter(text: str, name: str) -> dict[str, float]:
    """drafter label -> value of the Prometheus sample ``name`` in an exposition."""
    return {sample.labels["drafter"]: sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples if sample.name == name}


def _data(c: httpx.Client) -> dict[str, Any]:
    time.sleep(1.1)  # the last second of traffic is over, so its point is in the series
    r = c.get("/dashboard/data")
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    return r.json()


def test_dashboard_page_and_data_on_a_live_server() -> None:
    with LiveServer(create_app(_engine(), ServerConfig(served_model_name=MODEL))) as s:
        _traffic(s.url, 0.0, clients=2)
        with httpx.Client(base_url=s.url, timeout=30) as c:
            page = c.get("/dashboard")
            assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
            srcs = re.findall(r'(?:src|href)="([^"]+)"', page.text)
            assert srcs and not [x for x in srcs if "//" in x or x.startswith("http")], srcs  # nothing from a CDN
            for src in srcs:  # the vendored chart library is served by the server itself
                assert c.get("/" + src).status_code == 200, src
            d = _data(c)
            metrics = c.get("/metrics").text
    # Prometheus says per drafter what the dashboard shows
    drafts = _by_drafter(metrics, "tidespec:spec_decode_drafter_num_drafts_total")
    tokens = _by_drafter(metrics, "tidespec:spec_decode_drafter_num_draft_tokens_total")
    accepted = _by_drafter(metrics, "tidespec:spec_decode_drafter_num_accepted_tokens_total")
    assert set(drafts) <= {"ngram", "suffix"} and sum(drafts.values()) > 0, drafts
    assert all(tokens[d] >= drafts[d] and 0 <= accepted[d] <= tokens[d] for d in drafts)
    chosen = _by_drafter(metrics, "tidespec:spec_policy_choices_total")
    assert set(chosen) <= {"ngram", "suffix", "none"} and sum(chosen.values()) >= sum(drafts.values())
    assert set(_by_drafter(metrics, "tidespec:spec_policy_drafter_predicted_speedup")) == {"ngram", "suffix"}
    assert d["t"] and len(d["t"]) == len(d["tokens_per_s"]["served"]) == len(d["gamma"])
    assert max(d["tokens_per_s"]["served"]) > 0
    assert any(v for v in d["tokens_per_s"]["decoding"] if v is not None)
    assert any(v for v in d["tokens_per_s"]["plain_estimate"] if v is not None)
    shadow = d["acceptance"]["shadow"]
    assert set(shadow) == {"ngram", "suffix"} and any(v is not None and v > 1 for v in shadow["suffix"])
    assert set(d["acceptance"]["drafters"]) <= {"ngram", "suffix"}
    # a route is listed once one of its requests drafted: the analytic policy, on a profile timed at
    # start-up, may give a route's few requests gamma 0 on a loaded machine (seen once in make test)
    assert d["acceptance"]["routes"] and set(d["acceptance"]["routes"]) <= {"code", "chat"}
    assert d["requests"] == {"code": 2, "chat": 2}
    assert d["buckets"] and all(b["policy_gamma"] is not None for b in d["buckets"])
    assert all(b.get("policy_drafter") in (None, "ngram", "suffix") for b in d["buckets"])
    assert d["server"]["drafter"] == "ngram+suffix" and d["policy"]["name"] == "analytic" and d["online"] is None
    assert d["drafters"] == [{"name": "ngram", "version": None}, {"name": "suffix", "version": None}]


def test_dashboard_is_behind_the_api_key() -> None:
    """With an API key the page and its data need it; a browser gets a Basic challenge (its login
    prompt: the key as password), API clients still a Bearer one."""
    with LiveServer(create_app(_engine(), ServerConfig(served_model_name=MODEL, api_key="sk-dash"))) as s:
        with httpx.Client(base_url=s.url, timeout=30) as c:
            for path in ("/dashboard", "/dashboard/data", "/dashboard/uPlot.iife.min.js"):
                r = c.get(path)
                assert r.status_code == 401 and r.headers["www-authenticate"] == 'Basic realm="tidespec"', path
                assert c.get(path, auth=("anyone", "wrong")).status_code == 401
                assert c.get(path, auth=("anyone", "sk-dash")).status_code == 200
                assert c.get(path, headers={"Authorization": "Bearer sk-dash"}).status_code == 200
            assert c.get("/v1/models").headers["www-authenticate"] == "Bearer"
            assert c.get("/v1/models", auth=("", "sk-dash")).status_code == 200
            assert c.get("/health").status_code == 200


# ----------------------------------------------------------------------------- browser
def _browser() -> str | None:
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    return None


def _chromium(browser: str, url: str, *args: str, size: str = "1280,1600") -> str:
    cmd = [browser, "--headless", "--disable-gpu", "--no-sandbox", "--hide-scrollbars", f"--window-size={size}",
           "--virtual-time-budget=6000", *args, url]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def _attrs(dom: str, element_id: str) -> dict[str, str]:
    m = re.search(rf'<div id="{element_id}"([^>]*)>', dom)
    assert m is not None, f"no #{element_id} in the page"
    return dict(re.findall(r'([\w-]+)="([^"]*)"', m.group(1)))


@pytest.mark.skipif(_browser() is None, reason=f"no headless browser on PATH (any of {', '.join(BROWSERS)}); "
                    "`apt-get install chromium-headless-shell` (make test does, as root)")
def test_dashboard_draws_in_a_headless_browser() -> None:
    browser = _browser()
    assert browser is not None
    screenshot = os.environ.get("TIDESPEC_SCREENSHOT") == "1"
    with LiveServer(create_app(_engine(), ServerConfig(served_model_name=MODEL))) as s:
        _traffic(s.url, 40.0 if screenshot else 0.0, clients=3 if screenshot else 2)
        time.sleep(1.1)
        dom = _chromium(browser, f"{s.url}/dashboard", "--dump-dom")
        status = _attrs(dom, "status")
        assert status["data-state"] == "ok" and int(status["data-updates"]) >= 1, status
        for chart in ("chart-tokens", "chart-drafters", "chart-routes", "chart-gamma"):
            assert int(_attrs(dom, chart)["data-points"]) > 0, chart
        assert int(_attrs(dom, "chart-tokens")["data-series"]) == 3  # served, decoding, plain estimate
        assert int(_attrs(dom, "chart-routes")["data-series"]) == 2  # code, chat
        assert dom.count('class="uplot') == 4  # the four charts were drawn by uPlot
        if screenshot:
            _chromium(browser, f"{s.url}/dashboard?smooth=3", f"--screenshot={SCREENSHOT}", size="1280,1040")
            assert SCREENSHOT.stat().st_size > 10_000


class _StubOnline:
    """What the dashboard reads of ``OnlineTraining``: ``state()`` (here with a trainer that died and
    a ``paused`` key, which the page shows when present)."""

    def __init__(self) -> None:
        self.snapshot: dict[str, Any] = {
            "drafter_version": 7, "collection_enabled": False, "captured": 5120, "dropped": 3, "flushed": 5000,
            "flush_errors": 0, "swaps": 6, "refused_versions": [4], "trainer_running": False, "paused": True,
            "trainer": {"state": "restarting", "pid": None, "restarts": 2, "deaths": 3, "last_exit": "signal 9",
                        "since_s": 1.5},
            "collector": {"alpha_short": 0.41, "alpha_long": 0.38, "collection_enabled": False, "initialized": True,
                          "num_requests": 90, "rounds": 5, "deployments": 4, "shifts_detected": 1,
                          "last_shift_request": 60, "last_decision": "deploy", "forced": False}}

    def state(self) -> dict[str, Any]:
        return self.snapshot

    def health(self) -> dict[str, Any]:
        return {"drafter_version": 7, "collection_enabled": False, "trainer": self.snapshot["trainer"]}


@pytest.mark.skipif(_browser() is None, reason=f"no headless browser on PATH (any of {', '.join(BROWSERS)})")
def test_dashboard_shows_the_online_training_state() -> None:
    browser = _browser()
    assert browser is not None
    app = create_app(tiny_engine(), ServerConfig(served_model_name=MODEL), online=_StubOnline())  # type: ignore[arg-type]
    with LiveServer(app) as s:
        with httpx.Client(base_url=s.url, timeout=30) as c:
            assert c.get("/dashboard/data").json()["online"]["trainer"]["state"] == "restarting"
        dom = _chromium(browser, f"{s.url}/dashboard", "--dump-dom")
    assert _attrs(dom, "status")["data-state"] == "ok"
    training = re.search(r'<table id="training">(.*?)</table>', dom, re.S)
    assert training is not None
    text = re.sub(r"<[^>]+>", " ", training.group(1))
    for shown in ("paused, dead (restarting)", "drafter version (online)", "restarts / deaths", "2 / 3",
                  "rounds / deployed", "5 / 4", "deploy", "off", "5120 / 3", "refused versions"):
        assert shown in text, (shown, text)
    assert "none (plain decoding)" in text
