"""``tidespec bench load``: configuration names, the verdict's arithmetic, the model check, one real run.

The end-to-end test launches real ``tidespec serve`` subprocesses on a tiny checkpoint (plain,
static-2, hybrid), replays a two-segment trace and one constant rate, and checks that every
request completes, the policy metrics were scraped (hybrid speculates at least once, so its
bucket shows a predicted and a measured speedup) and the report and plots are written.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import tiny_hf_model, write_tiny_checkpoint
from tidespec.bench.load.analysis import averaged, forward_vs_profile, model_check, trace_headroom, verdict
from tidespec.bench.load.config import ConfigName, LoadBenchConfig, RunResult, server_args
from tidespec.bench.load.report import policy_state
from tidespec.bench.load.run import diff_steps, replot, run_load_bench
from tidespec.config import ConfigError
from tidespec.speculative.policy.speedup import Profile


def _summary(tok_s: float, e2e: float) -> dict:
    pct = {"mean": e2e, "p50": e2e, "p90": e2e, "p99": e2e}
    return {"output_tok_per_s": tok_s, "e2e_s": pct, "ttft_s": pct, "tpot_s": pct, "completed": 1,
            "num_requests": 1, "acceptance_rate": 0.0}


def test_server_args_per_configuration() -> None:
    cfg = LoadBenchConfig(drafter="ngram", gamma_max=4, threads=2, max_num_seqs=8)
    assert server_args("plain", cfg).startswith("--drafter none ")
    assert server_args("static-3", cfg).startswith("--drafter ngram --policy static --num-speculative-tokens 3 ")
    assert server_args("hybrid", cfg).startswith("--drafter ngram --policy hybrid --num-speculative-tokens 4 ")
    assert "--threads 2 --max-num-seqs 8" in server_args("bandit", cfg)
    both = LoadBenchConfig(drafter="suffix,eagle3", eagle3_dir="/boot", gamma_max=4,
                           configs=("plain", "eagle3:static-2", "analytic", "suffix+eagle3:hybrid:online"))
    assert server_args("eagle3:static-2", both).startswith(
        "--drafter eagle3 --policy static --num-speculative-tokens 2 --eagle3-dir /boot ")
    assert server_args("analytic", both).startswith("--drafter suffix,eagle3 --policy analytic ")
    online = server_args("suffix+eagle3:hybrid:online", both, "/runs/root")
    assert online.startswith("--drafter suffix,eagle3 --policy hybrid --num-speculative-tokens 4 "
                             "--eagle3-dir /runs/root --online-training ")
    assert ConfigName.parse("suffix+eagle3:analytic:online", "x") == ConfigName("suffix,eagle3", "analytic", True)


@pytest.mark.parametrize("kwargs, message", [
    ({"configs": ("static-x",)}, "integer G"),
    ({"configs": ("static",)}, "unknown configuration"),
    ({"configs": ("fastest",)}, "unknown configuration"),
    ({"rates": (0.0,)}, "rates"),
    ({"duration": 0.0}, "duration"),
    ({"drafter": "none"}, "plain decoding"),
    ({"drafter": "suffix,eagle3", "configs": ("static-2",)}, "several drafters"),
    ({"configs": ("suffix:analytic:online",)}, "online training needs eagle3"),
    ({"configs": ("a:b:c:d",)}, "bad configuration"),
    ({"configs": ("bogus:static-2",)}, "drafter must be one of"),
])
def test_config_validation(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        LoadBenchConfig(**kwargs)


def test_verdict_hand_traced() -> None:
    """Rate 0.4: best static static-2 (24 tok/s), best adaptive hybrid (23.5): 0.979.
    Rate 2: plain 60 is the best static, analytic 59: 0.983 of both best static and plain.
    Trace: hybrid 30 tok/s vs best static plain 25 (+20 %); mean e2e 2.0 s vs 2.5 s (+20 %)."""
    cfg = LoadBenchConfig(rates=(0.4, 2.0), configs=("plain", "static-2", "analytic", "hybrid"))
    rs = [RunResult("plain", "rate", 0.4, _summary(20, 1.0)), RunResult("static-2", "rate", 0.4, _summary(24, 0.8)),
          RunResult("hybrid", "rate", 0.4, _summary(23.5, 0.8)), RunResult("analytic", "rate", 0.4, _summary(21, 1)),
          RunResult("plain", "rate", 2.0, _summary(60, 5)), RunResult("static-2", "rate", 2.0, _summary(50, 6)),
          RunResult("analytic", "rate", 2.0, _summary(59, 5)), RunResult("hybrid", "rate", 2.0, _summary(40, 7)),
          RunResult("plain", "trace", None, _summary(25, 2.5)), RunResult("static-2", "trace", None, _summary(22, 3)),
          RunResult("hybrid", "trace", None, _summary(30, 2.0))]
    v = verdict(rs, cfg)
    r04, r2 = v["per_rate"]
    assert (r04["best_static"], r04["best_adaptive"]) == ("static-2", "hybrid")
    assert r04["ratio"] == pytest.approx(23.5 / 24)
    assert (r2["best_static"], r2["best_adaptive"]) == ("plain", "analytic")
    assert r2["ratio"] == pytest.approx(59 / 60) and r2["adaptive_over_plain"] == pytest.approx(59 / 60)
    t = v["trace"]
    assert t["best_adaptive"] == "hybrid" and t["throughput_margin"] == pytest.approx(0.2)
    assert t["lowest_latency_static"] == "plain" and t["latency_margin"] == pytest.approx(0.2)
    assert "model_abs_error" not in v  # no profile, no model check


def _steps(steps: float, seqs: float, total: float, forward: float, draft: float, emitted: float,
           drafted: float) -> dict[str, float]:
    return {"steps": steps, "seqs": seqs, "total": total, "forward": forward, "draft": draft,
            "other": total - forward - draft, "emitted": emitted, "drafted": drafted}


def test_model_check_hand_traced() -> None:
    """model_check's docstring example: plain bucket 4 at 25 ms per token, static-3 at 15 ms ->
    measured 1.667; eq. 5 2.5 * 0.08 / 0.114 = 1.754. Bucket 1 has too few steps; the trace has
    no plain run to compare with."""
    profile = Profile(target_latency={1: 0.05}, draft_cost={"default": 0.004},
                      verify_latency={(4, 1): 0.08, (4, 4): 0.11})
    plain = RunResult("plain", "rate", 1.0, _summary(1, 1), steps={
        "4": _steps(100, 400, 10.0, 8.0, 0.0, 400, 0), "1": _steps(5, 5, 0.3, 0.25, 0, 5, 0)})
    spec = RunResult("static-3", "rate", 1.0, _summary(1, 1), steps={
        "4": _steps(50, 200, 7.5, 5.0, 0.2, 500, 600), "1": _steps(50, 50, 3.0, 2.5, 0.1, 120, 150)})
    lone = RunResult("static-3", "trace", None, _summary(1, 1), steps={"4": _steps(50, 200, 7.5, 5, 0.2, 500, 600)})
    rows = model_check([plain, spec, lone], profile, min_steps=20)
    assert len(rows) == 1
    x = rows[0]
    assert (x["config"], x["bucket"], x["mean_batch"]) == ("static-3", 4, 4.0)
    assert x["measured"] == pytest.approx(25 / 15)
    assert x["predicted"] == pytest.approx(2.5 * 0.08 / 0.114)
    assert x["plain_forward_vs_profile"] == pytest.approx(1.0) and x["draft_ms"] == pytest.approx(4.0)
    assert x["forward_vs_profile"] == pytest.approx(0.1 / 0.11)
    cfg = LoadBenchConfig(rates=(1.0,), configs=("plain", "static-3", "hybrid"))
    v = verdict([plain, spec, lone], cfg, rows)
    assert v["model_abs_error"]["n"] == 1
    assert v["model_abs_error"]["median"] == pytest.approx(abs(x["predicted"] / x["measured"] - 1))


def test_verdict_compares_means_over_repeats() -> None:
    """Two rounds: plain 40 and 36 (mean 38), bandit 37 and 37 (mean 37): ratio 37 / 38 = 0.974,
    although round 1 alone would give 0.925."""
    cfg = LoadBenchConfig(rates=(1.5,), configs=("plain", "bandit"), repeats=2)
    rs = [RunResult("plain", "rate", 1.5, _summary(40, 2.0), repeat=0),
          RunResult("bandit", "rate", 1.5, _summary(37, 2.2), repeat=0),
          RunResult("plain", "rate", 1.5, _summary(36, 2.4), repeat=1),
          RunResult("bandit", "rate", 1.5, _summary(37, 2.2), repeat=1)]
    row = verdict(rs, cfg)["per_rate"][0]
    assert (row["best_static"], row["best_adaptive"]) == ("plain", "bandit")
    assert row["ratio"] == pytest.approx(37 / 38) and row["best_static_runs"] == [40, 36]
    assert averaged(rs)[0].summary["e2e_s"]["mean"] == pytest.approx(2.2)


def test_diff_steps_isolates_one_run() -> None:
    after = {"4": {"steps": 10.0, "total": 2.0}, "8": {"steps": 3.0, "total": 1.0}}
    before = {"4": {"steps": 4.0, "total": 0.5}, "8": {"steps": 3.0, "total": 1.0}}
    assert diff_steps(after, before) == {"4": {"steps": 6.0, "total": 1.5}}


def test_forward_vs_profile_and_policy_state_hand_traced() -> None:
    """The docstring examples: a bucket of plain steps 1.33x slower than the profile; a bucket
    that drafted one token per sequence-step is priced at T(b, 2); the policy's state line."""
    prof = Profile(target_latency={1: 0.01}, draft_cost={"default": 0.0},
                   verify_latency={(8, 1): 0.015, (16, 1): 0.015, (8, 2): 0.02, (16, 2): 0.02})
    assert forward_vs_profile({"16": {"steps": 100.0, "seqs": 1000.0, "forward": 2.0}}, prof) == pytest.approx(4 / 3)
    two = {"16": {"steps": 100.0, "seqs": 1000.0, "forward": 2.0},
           "8": {"steps": 50.0, "seqs": 400.0, "forward": 1.0, "drafted": 400.0}}
    assert forward_vs_profile(two, prof) == pytest.approx(3.0 / (1.5 + 50 * 0.02))
    assert forward_vs_profile({}, prof) is None
    assert policy_state({"gamma_b1": 4.0, "alpha_b1": 0.451, "rho_b1": 0.62, "alpha_b16": 0.4, "rho_b16": 0.55,
                         "probe_steps": 3.0}) == "b1: 4 / 0.45 / 0.62, b16: - / 0.40 / 0.55"
    assert policy_state({"explore_steps": 1.0}) == "-"


def test_trace_headroom_hand_traced() -> None:
    """The docstring example: oracle 1.043x plain, best single static static-1 at 1.023x."""
    plain = RunResult("plain", "trace", None, _summary(1.0, 1.0),
                      steps={"1": {"steps": 10.0, "total": 10.0}, "16": {"steps": 10.0, "total": 30.0}})
    checks = [{"config": "static-4", "kind": "trace", "repeat": 0, "bucket": 1, "measured": 1.2},
              {"config": "static-4", "kind": "trace", "repeat": 0, "bucket": 16, "measured": 0.9},
              {"config": "static-1", "kind": "trace", "repeat": 0, "bucket": 1, "measured": 1.1},
              {"config": "static-1", "kind": "trace", "repeat": 0, "bucket": 16, "measured": 1.0},
              {"config": "analytic", "kind": "trace", "repeat": 0, "bucket": 16, "measured": 2.0},  # not a static
              {"config": "static-1", "kind": "rate", "repeat": 0, "bucket": 16, "measured": 3.0}]  # not the trace
    (h,) = trace_headroom([plain], checks)
    assert h["oracle_over_plain"] == pytest.approx(40 / (10 / 1.2 + 30))
    assert h["best_static"] == "static-1" and h["best_static_over_plain"] == pytest.approx(40 / (10 / 1.1 + 30))
    assert trace_headroom([plain], []) == []


@pytest.mark.slow  # two real servers and a rate sweep: 33-72 s on 2 cores, make test-slow
def test_load_bench_end_to_end_through_real_servers(tmp_path: Path) -> None:
    hf, _ = tiny_hf_model("llama", torch.float32)
    ckpt = write_tiny_checkpoint(hf, tmp_path / "ckpt")
    prompts = [" ".join(["t21 t22 t23 t24"] * 4), " ".join(["t30 t31 t32"] * 5)]
    wl = tmp_path / "wl.jsonl"
    wl.write_text("".join(json.dumps({"id": f"p{i}", "domain": "code", "kind": "completion", "prompt": p}) + "\n"
                          for i, p in enumerate(prompts)), encoding="utf-8")
    cfg = LoadBenchConfig(workload=str(wl), model=str(ckpt), rates=(4.0,), duration=1.0,
                          trace=((0.0, 4.0), (1.0, 0.0)), configs=("plain", "static-2", "hybrid"), drafter="ngram",
                          gamma_max=3, max_tokens=12, max_num_seqs=4, threads=1, min_steps=1)
    out = tmp_path / "out"
    doc = run_load_bench(cfg, out, command="test")
    results = doc["results"]
    assert [(r["config"], r["kind"]) for r in results] == [
        ("plain", "trace"), ("plain", "rate"), ("static-2", "trace"), ("static-2", "rate"),
        ("hybrid", "trace"), ("hybrid", "rate")]
    for r in results:
        s = r["summary"]
        assert s["completed"] == s["num_requests"] >= 1 and s["errors"] == 0, r["config"]
        assert s["total_output_tokens"] == 12 * s["completed"]
    assert all(not r["speedup"] for r in results if r["config"] == "plain")  # no policy, no policy metrics
    static = [r for r in results if r["config"] == "static-2"]
    assert all(1 <= v["gamma"] <= 2 and v["predicted"] > 0 and v["measured"] > 0  # guards cap gamma at the end
               for r in static for v in r["speedup"].values())
    assert doc["verdict"]["per_rate"][0]["rate"] == 4.0 and "trace" in doc["verdict"]
    assert all(r["steps"] and all(b["steps"] >= 1 for b in r["steps"].values()) for r in results)  # every server
    assert all(b["drafted"] == 0 for r in results if r["config"] == "plain" for b in r["steps"].values())
    checks = doc["model_check"]
    assert checks and all(x["config"] != "plain" and x["measured"] > 0 and x["predicted"] > 0 for x in checks)
    for name in ("bench_load.json", "README.md", "sweep.png", "trace.png", "speedup.png", "profile.json"):
        assert (out / name).stat().st_size > 0, name
    readme = (out / "README.md").read_text(encoding="utf-8")
    assert "Verdict per rate" in readme and "fwd/profile" in readme
    hybrid = [r for r in results if r["config"] == "hybrid"]
    assert all("alpha" in r["policy"] and "rho" in r["policy"] for r in hybrid)  # scraped from /metrics
    assert "Policy state at the end of each run" in readme
    (out / "README.md").unlink()
    again = replot(out)  # re-rendered from bench_load.json alone
    assert again["verdict"] == doc["verdict"] and (out / "README.md").is_file()


def test_token_times_spread_tokens_over_chunks() -> None:
    from tidespec.bench.load.report import token_times
    from tidespec.bench.serve.run import RequestRecord

    recs = [RequestRecord(0, "a", "code", "completion", 0.0, completion_tokens=6, chunk_times_s=[1.0, 2.0]),
            RequestRecord(1, "b", "code", "completion", 0.0, completion_tokens=0)]
    assert token_times(recs) == ([1.0, 2.0], [3.0, 3.0])
