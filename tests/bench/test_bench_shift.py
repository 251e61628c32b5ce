"""``tidespec bench shift``: the trace's phases, config validation, the curves, and one real run.

The end-to-end run uses a tiny float64 checkpoint (so greedy outputs must match plain exactly):
plain, frozen (fresh head) and online (capture, selective collection in bootstrap mode, a real
``train-drafter`` child process) over a three-phase trace, then the capture-overhead pair and
the signals-vs-recompute epoch; whether the trainer publishes in time is not asserted (timing).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import pytest
import torch

from tests.helpers import capture, checkpoint_tokenizer, tiny_hf_model, tiny_llama, write_tiny_checkpoint
from tidespec.bench.decode.run import resolve_target
from tidespec.bench.shift.config import ShiftBenchConfig, build_trace
from tidespec.bench.shift.measure import recompute_taps
from tidespec.bench.shift.report import _curves, _gate_lines, _share_lines, config_colors, quarter_shares
from tidespec.bench.shift.run import quarter_acceptance, replot, run_shift_bench, summarize_run, tokens_per_step
from tidespec.bench.shift.runs import TraceLoop, no_learning_config, run_trace, trace_engine_config
from tidespec.config import ConfigError, EngineConfig, ModelConfig
from tidespec.llm import build_engine
from tidespec.speculative.drafters.eagle3_options import Eagle3Options
from tidespec.speculative.drafters.multi import find_member
from tidespec.speculative.drafters.suffix import SuffixOptions


def _workload(path: Path, domain: str, n: int, base: int) -> Path:
    lines = [json.dumps({"id": f"{domain}-{i}", "domain": domain, "kind": "completion",
                         "prompt": " ".join(f"w{base + (i + j) % 7}" for j in range(6))}) for i in range(n)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_trace_phases_take_fresh_records(tmp_path: Path) -> None:
    a = _workload(tmp_path / "a.jsonl", "a", 12, 10)
    b = _workload(tmp_path / "b.jsonl", "b", 6, 40)
    cfg = ShiftBenchConfig(workloads=f"{a},{b}:3,{a}", requests_per_phase=4, offset=2)
    assert cfg.phase_specs == [(str(a), 4), (str(b), 3), (str(a), 4)]
    trace = build_trace(cfg, checkpoint_tokenizer())
    assert [(t.phase, t.workload, t.prompt.record.id) for t in trace] == [
        (0, "a", "a-2"), (0, "a", "a-3"), (0, "a", "a-4"), (0, "a", "a-5"), (1, "b", "b-2"), (1, "b", "b-3"),
        (1, "b", "b-4"), (2, "a", "a-6"), (2, "a", "a-7"), (2, "a", "a-8"), (2, "a", "a-9")]
    with pytest.raises(ConfigError, match="records 2..6"):
        build_trace(ShiftBenchConfig(workloads=str(b), requests_per_phase=5, offset=2), checkpoint_tokenizer())


def test_the_profile_flag_reaches_the_eagle3_configurations_only(tmp_path: Path) -> None:
    """``--profile`` prices frozen and online (their policy); the static configurations take none."""
    a = _workload(tmp_path / "a.jsonl", "a", 4, 10)
    prof = tmp_path / "profile.json"
    prof.write_text("{}", encoding="utf-8")
    cfg = ShiftBenchConfig(workloads=str(a), requests_per_phase=2, drafter="suffix,eagle3", policy="analytic",
                           profile=str(prof))
    trace = build_trace(cfg, checkpoint_tokenizer())
    model = tiny_llama(64)
    eagle3 = trace_engine_config(trace, cfg, model, cfg.gamma)
    assert (eagle3.policy.name, eagle3.policy.profile) == ("analytic", str(prof))
    suffix = trace_engine_config(trace, cfg, model, cfg.gamma, drafter="suffix")
    assert (suffix.policy.name, suffix.policy.profile) == ("static", None)


def test_per_sequence_compile_and_the_cache_length_reach_the_eagle3_configurations(tmp_path: Path) -> None:
    """``--per-sequence`` prices frozen and online per sequence; ``--compile`` compiles every configuration's
    step; ``--max-model-len`` fixes every configuration's cache (one compiled shape), and below the trace's
    longest request it is a one-line error."""
    a = _workload(tmp_path / "a.jsonl", "a", 4, 10)
    cfg = ShiftBenchConfig(workloads=str(a), requests_per_phase=2, drafter="suffix,eagle3", policy="analytic",
                           per_sequence=True, compile=True, max_model_len=200)
    trace, model = build_trace(cfg, checkpoint_tokenizer()), tiny_llama(64)
    eagle3 = trace_engine_config(trace, cfg, model, cfg.gamma)
    assert eagle3.policy.per_sequence and eagle3.model.compile and eagle3.cache.max_model_len == 200
    plain = trace_engine_config(trace, cfg, model, 0, drafter="suffix")
    assert not plain.policy.per_sequence and plain.model.compile and plain.cache.max_model_len == 200
    with pytest.raises(ConfigError, match="below the trace's longest request"):
        trace_engine_config(trace, dataclasses.replace(cfg, max_model_len=20), model, cfg.gamma)
    with pytest.raises(ConfigError, match="--per-sequence needs --policy analytic"):
        ShiftBenchConfig(workloads=str(a), requests_per_phase=2, drafter="suffix,eagle3", policy="hybrid",
                         per_sequence=True)


def test_the_chain_floor_reaches_the_engine(tmp_path: Path) -> None:
    """``--eagle3-min-draft-prob`` is serving's default unless given; 0 makes every chain --gamma long."""
    a = _workload(tmp_path / "a.jsonl", "a", 4, 10)
    trace = build_trace(ShiftBenchConfig(workloads=str(a), requests_per_phase=2), checkpoint_tokenizer())
    for floor in (None, 0.0):
        cfg = ShiftBenchConfig(workloads=str(a), requests_per_phase=2,
                               **({} if floor is None else {"eagle3_min_draft_prob": floor}))
        got = trace_engine_config(trace, cfg, tiny_llama(64), cfg.gamma).spec.options["eagle3"].min_draft_prob
        assert got == (Eagle3Options().min_draft_prob if floor is None else floor)


@pytest.mark.parametrize("kwargs, message", [
    ({"configs": "plain,fast"}, "subset"),
    ({"configs": ""}, "subset"),
    ({"workloads": " , "}, "at least one"),
    ({"gamma": 0}, "gamma"),
    ({"bootstrap": "/no/such/dir"}, "not a directory"),
    ({"signal_dir": "/no/such/dir"}, "not a directory"),
    ({"profile": "/no/such/profile.json"}, "not a file"),
    ({"collect_epsilon": 1.0}, "collect_epsilon"),
    ({"workloads": "code:0"}, "request count"),
    ({"drafter": "suffix"}, "include eagle3"),
    ({"drafter": "suffix,eagle3"}, "analytic"),
    ({"policy": "oracle"}, "policy"),
    ({"trainer_share": 1.5}, "trainer_share"),
    ({"eagle3_min_draft_prob": 1.0}, "min-draft-prob"),
    ({"configs": "plain,vocab-dynamic:4096"}, "configs must be"),
    ({"configs": "vocab-static:0"}, "configs must be"),
])
def test_config_validation(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ShiftBenchConfig(**kwargs)


def test_curves_window_acceptance_and_bin_rates() -> None:
    """Windows of 2 finished requests: (3 + 2) / 2 = 2.5 and (1 + 1) / 1 = 2.0; 10 tokens in
    [0, 1) s and 4 in [1, 1.5] s -> 10 tok/s and 8 tok/s."""
    run = {"requests": [{"t_end": 1.0, "drafts": 1, "accepted": 2}, {"t_end": 0.5, "drafts": 1, "accepted": 1},
                        {"t_end": 2.0, "drafts": 1, "accepted": 1}],
           "steps": [{"t": 0.2, "emitted": 6}, {"t": 0.9, "emitted": 4}, {"t": 1.5, "emitted": 4}]}
    xs, ys, ts, rates = _curves(run, window=2, bin_s=1.0)
    assert (xs, ys) == ([2, 3], [2.5, 2.0])
    assert ts == [0.5, 1.25] and rates == [10.0, 8.0]


def test_recompute_taps_match_the_engine_forward() -> None:

    _, target = tiny_hf_model("qwen2", torch.float64)
    ids = [5, 9, 11, 3, 7, 20]
    assert torch.equal(recompute_taps(target, ids, (0, 1, 2)), capture(target, ids, (0, 1, 2)))


def test_shift_bench_end_to_end(tmp_path: Path) -> None:
    hf, _ = tiny_hf_model("qwen2", torch.float64)
    ckpt = write_tiny_checkpoint(hf, tmp_path / "ckpt")
    a = _workload(tmp_path / "a.jsonl", "a", 6, 10)
    b = _workload(tmp_path / "b.jsonl", "b", 3, 40)
    cfg = ShiftBenchConfig(workloads=f"{a},{b},{a}", requests_per_phase=3, max_tokens=10, gamma=3, concurrency=2,
                           draft_vocab=0, min_signals=16, trainer_epochs=1.0, window=2, bin_s=0.5,
                           overhead_repeats=1, overhead_requests=2, recompute_rows=64, capture_prompt=True)
    target = resolve_target(str(ckpt), "float64")
    out = tmp_path / "out"
    doc = run_shift_bench(cfg, target, out, command="test", progress=False, log=lambda _: None)
    configs = doc["configs"]
    assert list(configs) == ["plain", "frozen", "online"]
    for name in ("frozen", "online"):
        assert configs[name]["mismatches"] == 0, name  # greedy speculation is lossless
        assert configs[name]["mean_acceptance_length"] >= 1.0
        assert [p["workload"] for p in configs[name]["phases"]] == ["a", "b", "a"]
    runs = doc["runs"]
    assert all(len(r["requests"]) == 9 and all(q["tokens"] == 10 for q in r["requests"]) for r in runs.values())
    online = configs["online"]["online"]
    assert online["captured"] > 0 and online["dropped"] == 0  # nothing published: collection bootstraps on
    assert online["trainer_running"] is False  # stopped with the run
    ov = doc["capture_overhead"]
    assert len(ov["pairs"]) == 1 and ov["ratio_on_off"] > 0
    ts = doc["training_sources"]
    assert ts["rows"] > 0 and ts["recompute_s"] > 0 and ts["speedup"] > 0
    for name in ("bench_shift.json", "README.md", "shift.png"):
        assert (out / name).stat().st_size > 0, name
    assert (out / "online" / "trainer.log").is_file()
    assert isinstance(online["judgements"], list)  # the trainer's served judgements, filed with the run
    saved = json.loads((out / "bench_shift.json").read_text())
    saved["configs"]["online"]["online"]["judgements"] = [
        {"version": 2, "replaced_version": 1, "judged_rows": 300, "accept_len": 1.41, "replaced_accept_len": 1.52,
         "reverted_as": 3},
        {"version": 4, "replaced_version": 3, "judged_rows": 320, "accept_len": 1.60, "replaced_accept_len": 1.55,
         "reverted_as": None, "confidence": 0.9, "gain_low": -0.02, "gain_high": 0.12}]
    (out / "bench_shift.json").write_text(json.dumps(saved))
    (out / "README.md").unlink()
    again = replot(out)  # re-rendered from bench_shift.json alone
    assert again["configs"]["online"]["mismatches"] == 0 and (out / "README.md").is_file()
    assert "latency speedup" in (out / "README.md").read_text() and "Mean request latency per phase" in (
        out / "README.md").read_text()
    text = (out / "README.md").read_text()
    assert "| 2 | 1 | 300 | 1.41 | 1.52 | - | reverted as v3 |" in text  # a record before judgements had intervals
    assert "| 4 | 3 | 320 | 1.60 | 1.55 | gain -0.02 .. +0.12 at 90 % | kept |" in text


def test_shift_bench_interleaves_a_controller_with_several_drafters(tmp_path: Path) -> None:
    """Everything on: suffix + EAGLE-3 under the analytic controller, online training yielding to
    serving, a static suffix baseline; the configurations take turns of 3 requests."""
    hf, _ = tiny_hf_model("qwen2", torch.float64)
    ckpt = write_tiny_checkpoint(hf, tmp_path / "ckpt")
    a = _workload(tmp_path / "a.jsonl", "a", 6, 10)
    b = _workload(tmp_path / "b.jsonl", "b", 3, 40)
    cfg = ShiftBenchConfig(workloads=f"{a},{b}", requests_per_phase=3, max_tokens=10, gamma=3, concurrency=2,
                           configs="plain,online,suffix", drafter="suffix,eagle3", policy="analytic", turn=3,
                           draft_vocab=0, min_signals=16, trainer_epochs=1.0, window=2, bin_s=0.5,
                           overhead_repeats=0, recompute_rows=0, capture_prompt=True, online_lora=True)
    doc = run_shift_bench(cfg, resolve_target(str(ckpt), "float64"), tmp_path / "out", command="test",
                          progress=False, log=lambda _: None)
    assert list(doc["configs"]) == ["plain", "online", "suffix"]
    for name in ("online", "suffix"):
        assert doc["configs"][name]["mismatches"] == 0, name
    turns = {n: r["turns"] for n, r in doc["runs"].items()}
    assert all(len(t) == 2 for t in turns.values())  # 6 requests in turns of 3
    order = sorted((span[0], n) for n, t in turns.items() for span in t)
    assert [n for _, n in order] == ["plain", "online", "suffix"] * 2  # they took turns
    online = doc["configs"]["online"]["online"]
    assert online["governor"] is not None and online["trainer_running"] is False
    assert online["lora"] is not None  # --online-lora: adapters between full rounds, merged by the engine
    served = [label for p in doc["configs"]["online"]["phases"] for label in p["served"]]
    assert served and all(re.fullmatch(r"v\d+(\+a\d+)?", label) for label in served), served
    quarters = doc["configs"]["online"]["phases"][0]["quarters"]
    assert len(quarters["served"]) == 4 and set(quarters) <= {"served", "suffix", "eagle3"}
    assert all("probe_steps" in r["policy"] for r in doc["runs"]["online"]["requests"])  # the controller's stats


def test_quarters_split_acceptance_by_requests_and_by_drafter() -> None:
    """Served acceptance per quarter of a phase's requests; each drafter's from the steps in that quarter."""
    reqs = [{"t_start": float(i), "t_end": i + 1.0, "drafts": 2, "accepted": i} for i in range(8)]
    steps = [{"t": i + 0.5, "by_drafter": {"suffix": 2, "eagle3": 1}, "accepted_by_drafter": {"suffix": 3, "eagle3": 0}}
             for i in range(8)]
    q = quarter_acceptance(reqs, steps)
    assert q["served"] == [(0 + 1 + 4) / 4, (2 + 3 + 4) / 4, (4 + 5 + 4) / 4, (6 + 7 + 4) / 4]
    assert q["suffix"] == [2.5] * 4 and q["eagle3"] == [1.0] * 4
    short = quarter_acceptance(reqs[:2], steps[:2])  # quarters without requests are nan, not errors
    assert math.isnan(short["served"][0]) and short["served"][1] == 1.0 and short["suffix"][3] == 2.5


def test_quarter_shares_count_each_route_of_the_sequence_steps() -> None:
    """Each route's share of a quarter's sequence-steps, none included; a quarter without steps is nan."""
    reqs = [{"t_start": float(i), "t_end": i + 1.0} for i in range(8)]
    steps = [{"t": i + 0.5, "decode_seqs": 4, "by_drafter": {"suffix": 2, "eagle3": 1} if i < 4 else {"suffix": 3}}
             for i in range(8)]
    shares = quarter_shares(reqs, steps)
    assert shares == {"eagle3": [0.25, 0.25, 0.0, 0.0], "none": [0.25, 0.25, 0.25, 0.25],
                      "suffix": [0.5, 0.5, 0.75, 0.75]}
    early = quarter_shares(reqs, steps[:2])  # both steps in the 1st quarter (requests 0-1): the others have none
    assert early["suffix"][0] == 0.5 and all(math.isnan(q) for q in early["suffix"][1:])
    zh = [dict(r, phase=0, workload="zh") for r in reqs]
    doc = {"runs": {"online": {"requests": zh, "steps": steps},
                    "frozen": {"requests": zh, "steps": [dict(s, by_drafter={"eagle3": 4}) for s in steps]}}}
    table = "\n".join(_share_lines(doc))
    assert "| online | 1: zh | suffix | 0.50 | 0.50 | 0.75 | 0.75 |" in table and "frozen" not in table


def test_gate_lines_count_the_epochs_of_each_phase() -> None:
    """The gate's epochs per phase are differences of the cumulative counters each finished request recorded."""
    def req(phase: int, t: float, epochs_in: float, epochs_out: float, arm: float) -> dict[str, object]:
        return {"phase": phase, "workload": ["code", "zh"][phase], "t_end": t,
                "policy": {"gate_in_b1": arm, "gate_diff_b1": -0.05, "gate_epochs_in_b1": epochs_in,
                           "gate_epochs_out_b1": epochs_out}}
    reqs = [req(0, 1.0, 2, 1, 1.0), req(0, 2.0, 5, 10, 1.0), req(1, 3.0, 7, 12, 0.0), req(1, 4.0, 9, 30, 0.0)]
    table = "\n".join(_gate_lines({"runs": {"online": {"requests": reqs, "steps": []},
                                            "plain": {"requests": [dict(r, policy={}) for r in reqs], "steps": []}}}))
    assert "| online | 1: code | 1 | 5 | 10 | in | -0.050 |" in table
    assert "| online | 2: zh | 1 | 4 | 20 | out | -0.050 |" in table and "plain" not in table
    assert _gate_lines({"runs": {"plain": {"requests": [{"phase": 0, "workload": "a", "t_end": 1.0}]}}}) == []



@pytest.mark.slow  # an online run, then every yield mode: 23-28 s on 2 cores, make test-slow
def test_yield_bench_on_a_shift_runs_store(tmp_path: Path) -> None:
    """bench yield on the store an online run filled: every mode and both idle rounds measured."""
    from tidespec.bench.yield_bench.run import YieldBenchConfig, run_yield_bench

    hf, _ = tiny_hf_model("qwen2", torch.float64)
    ckpt = write_tiny_checkpoint(hf, tmp_path / "ckpt")
    a = _workload(tmp_path / "a.jsonl", "a", 6, 10)
    target = resolve_target(str(ckpt), "float64")
    shift = ShiftBenchConfig(workloads=f"{a}:4", max_tokens=12, gamma=3, concurrency=2, configs="online",
                             draft_vocab=0, min_signals=10_000, collect_force=True, overhead_repeats=0,
                             recompute_rows=0, capture_prompt=True)
    run_shift_bench(shift, target, tmp_path / "shift", command="test", progress=False, log=lambda _: None)
    signals = tmp_path / "shift" / "online" / "signals"
    cfg = YieldBenchConfig(signal_dir=str(signals), workload=str(a), requests=2, max_tokens=8, concurrency=2,
                           repeats=1, epochs=1.0, shares="0.5,0")
    assert cfg.modes == {"none": None, "governed": 0.0, "share 0.5": 0.5, "free": None}
    assert list(dataclasses.replace(cfg, free=False).modes) == ["none", "governed", "share 0.5"]
    doc = run_yield_bench(cfg, target, tmp_path / "yield", command="test", log=lambda _: None)
    assert list(doc["saturation_tok_s"]) == ["none", "governed", "share 0.5", "free"]
    assert all(v[0] > 0 for v in doc["saturation_tok_s"].values())
    assert all(v[0] > 0 for v in doc["idle_round_s"].values()) and doc["idle_ratio"] > 0
    assert (tmp_path / "yield" / "yield.png").is_file()
    with pytest.raises(ConfigError, match="signal"):
        YieldBenchConfig(signal_dir=str(tmp_path / "none"))
    with pytest.raises(ConfigError, match="comma-separated numbers"):
        YieldBenchConfig(signal_dir=str(signals), shares="0.1,a")
    with pytest.raises(ConfigError, match="every trainer share"):
        YieldBenchConfig(signal_dir=str(signals), shares="1.5")


def test_shift_bench_compares_draft_vocabularies(tmp_path: Path) -> None:
    """EvoSpec's configurations beside the frozen head: a static frequency core, the dynamic
    core + buffer, the whole vocabulary; per phase coverage of V_t and draft time per token."""
    hf, _ = tiny_hf_model("qwen2", torch.float64)
    ckpt = write_tiny_checkpoint(hf, tmp_path / "ckpt")
    a = _workload(tmp_path / "a.jsonl", "a", 6, 10)
    b = _workload(tmp_path / "b.jsonl", "b", 3, 40)
    cfg = ShiftBenchConfig(workloads=f"{a},{b}", requests_per_phase=3, max_tokens=10, gamma=3, concurrency=1,
                           configs="plain,frozen,vocab-static,vocab-dynamic,vocab-full,vocab-static:6,"
                                   "vocab-dynamic:6:2", turn=3, draft_vocab=0,
                           vocab_core=8, vocab_buffer=4, vocab_corpus=str(a), window=2, bin_s=0.5,
                           overhead_repeats=0, recompute_rows=0)
    out = tmp_path / "out"
    doc = run_shift_bench(cfg, resolve_target(str(ckpt), "float64"), out, command="test", progress=False,
                          log=lambda _: None)
    configs = doc["configs"]
    for name in ("vocab-static", "vocab-dynamic", "vocab-full"):
        assert configs[name]["mismatches"] == 0, name
        assert all(0.0 <= p["coverage"] <= 1.0 and p["draft_ms_per_token"] > 0 for p in configs[name]["phases"])
    assert configs["vocab-full"]["vocab"]["coverage"] == 1.0
    assert configs["vocab-static"]["vocab"]["size"] == 12 and configs["vocab-dynamic"]["vocab"]["core"] == 8
    assert configs["vocab-dynamic"]["vocab"]["size"] <= 12 and configs["vocab-dynamic"]["vocab"]["errors"] == 0
    report = (out / "README.md").read_text()
    assert "coverage % / accept len / draft ms per token" in report and "x frozen)" in report
    assert configs["vocab-dynamic"]["draft_ms_per_token"] > 0 and "mean_build_ms" in configs["vocab-dynamic"]["vocab"]
    sized = configs["vocab-dynamic:6:2"]["vocab"]  # a size sweep's configurations: the sizes they name
    assert configs["vocab-static:6"]["vocab"]["size"] == 6 and sized["core"] == 6 and sized["size"] <= 8
    assert configs["vocab-dynamic:6:2"]["mismatches"] == 0


def test_trace_requests_can_end_at_eos(tmp_path: Path) -> None:
    """``ignore_eos=False`` (``--no-ignore-eos``): a request ends at its EOS, as a served one does."""
    a = _workload(tmp_path / "a.jsonl", "a", 2, 10)
    trace = build_trace(ShiftBenchConfig(workloads=str(a), requests_per_phase=2), checkpoint_tokenizer())
    model = tiny_llama(dtype=torch.float64)
    engine = build_engine(EngineConfig(model=ModelConfig(dtype="float64")), model, checkpoint_tokenizer())
    full = run_trace(engine, trace, 1, 8, "full", progress=False).outputs
    stop = full[0][2]  # the first request's third token becomes the EOS
    model.cfg = dataclasses.replace(model.cfg, eos_token_ids=(stop,))
    engine = build_engine(EngineConfig(model=ModelConfig(dtype="float64")), model, checkpoint_tokenizer())
    cut = run_trace(engine, trace, 1, 8, "eos", progress=False, ignore_eos=False).outputs
    assert cut[0] == full[0][:full[0].index(stop) + 1]
    again = run_trace(engine, trace, 1, 8, "ignored", progress=False).outputs  # the default ignores it
    assert again == full


def test_open_loop_arrivals_leave_the_engine_idle_between_requests(tmp_path: Path) -> None:
    """``--arrival-rate``: a request is admitted at its arrival on the loop's clock, its latency is
    counted from there, and nothing steps while nothing has arrived; the outputs are the closed loop's."""
    a = _workload(tmp_path / "a.jsonl", "a", 3, 10)
    trace = build_trace(ShiftBenchConfig(workloads=str(a), requests_per_phase=3), checkpoint_tokenizer())
    engine = build_engine(EngineConfig(model=ModelConfig(dtype="float64")), tiny_llama(dtype=torch.float64),
                          checkpoint_tokenizer())
    closed = run_trace(engine, trace, 4, 6, "closed", progress=False)
    loop = TraceLoop(engine, trace, 4, 6, "open", progress=False, arrivals=[0.0, 0.4, 0.8])
    loop.run_turn(len(trace))
    run = loop.finish()
    assert run.outputs == closed.outputs
    assert [round(r["t_start"], 1) for r in run.requests] == [0.0, 0.4, 0.8]
    assert all(r["t_end"] < r["t_start"] + 0.4 for r in run.requests)  # each done before the next arrives
    gaps = [b["t"] - a["t"] for a, b in zip(run.steps, run.steps[1:])]
    assert sum(g > 0.2 for g in gaps) == 2 and run.wall_s >= 0.8  # two idle gaps, no step in them
    summary = summarize_run(run, trace, closed)  # latency counts from the arrival; its speedup is against plain's
    mean = sum(r["t_end"] - r["t_start"] for r in run.requests) / 3
    assert summary["mean_latency_s"] == pytest.approx(mean)
    assert summary["phases"][0]["mean_latency_s"] == pytest.approx(mean)
    plain_mean = sum(r["t_end"] - r["t_start"] for r in closed.requests) / 3
    assert summary["latency_speedup"] == pytest.approx(plain_mean / mean)
    with pytest.raises(ConfigError, match="arrival_rate"):
        ShiftBenchConfig(arrival_rate=float("nan"))


def test_trees_reach_every_speculating_configuration_and_stay_lossless(tmp_path: Path) -> None:
    """``--tree``: frozen EAGLE-3 and suffix propose trees of --gamma tokens; the report says so and
    the served outputs are plain decoding's."""
    hf, _ = tiny_hf_model("qwen2", torch.float64)
    ckpt = write_tiny_checkpoint(hf, tmp_path / "ckpt")
    a = _workload(tmp_path / "a.jsonl", "a", 6, 10)
    cfg = ShiftBenchConfig(workloads=str(a), requests_per_phase=4, max_tokens=10, gamma=3, concurrency=2,
                           configs="plain,frozen,suffix", tree=True, turn=2, draft_vocab=0, window=2, bin_s=0.5,
                           overhead_repeats=0, recompute_rows=0)
    trace = build_trace(cfg, checkpoint_tokenizer())
    for drafter in (None, "suffix"):
        assert trace_engine_config(trace, cfg, tiny_llama(64), cfg.gamma, drafter=drafter).spec.tree
    out = tmp_path / "out"
    doc = run_shift_bench(cfg, resolve_target(str(ckpt), "float64"), out, command="test", progress=False,
                          log=lambda _: None)
    for name in ("frozen", "suffix"):
        assert doc["configs"][name]["mismatches"] == 0, name
    assert doc["configs"]["frozen"]["mean_acceptance_length"] >= 1.0
    assert "gamma 3 (trees)" in (out / "README.md").read_text()


def test_no_learning_keeps_frozen_drafters_but_no_suffix_tree_of_past_outputs(tmp_path: Path) -> None:
    """``no-learning`` is frozen's controller over suffix + EAGLE-3 with nothing carried across
    requests: its suffix drafter keeps no global tree (frozen's does), and it serves losslessly."""
    hf, _ = tiny_hf_model("qwen2", torch.float64)
    ckpt = write_tiny_checkpoint(hf, tmp_path / "ckpt")
    a = _workload(tmp_path / "a.jsonl", "a", 4, 10)
    cfg = ShiftBenchConfig(workloads=str(a), requests_per_phase=4, max_tokens=10, gamma=3, concurrency=2,
                           configs="plain,frozen,no-learning", drafter="suffix,eagle3", policy="analytic", turn=2,
                           draft_vocab=0, window=2, bin_s=0.5, overhead_repeats=0, recompute_rows=0)
    target = resolve_target(str(ckpt), "float64")
    ecfg = trace_engine_config(build_trace(cfg, target.tokenizer), cfg, target.model, cfg.gamma)
    trees = {name: find_member(build_engine(c, target.model, target.tokenizer).drafter, "suffix").max_tree_tokens
             for name, c in (("frozen", ecfg), ("no-learning", no_learning_config(ecfg)))}
    frozen = ecfg.spec.options_for("suffix", SuffixOptions).max_tree_tokens
    assert trees == {"frozen": frozen, "no-learning": 0} and trees["frozen"] > 0
    doc = run_shift_bench(cfg, target, tmp_path / "out", command="test", progress=False, log=lambda _: None)
    assert list(doc["configs"]) == ["plain", "frozen", "no-learning"]
    assert doc["configs"]["no-learning"]["mismatches"] == 0
    steps = doc["configs"]["frozen"]["phases"][0]["quarter_tokens_per_step"]
    assert len(steps) == 4 and all(q >= 1.0 for q in steps)  # plain decoding's 1.0 or more
    text = (tmp_path / "out" / "README.md").read_text()
    assert "Tokens per target step" in text and "ratio to no-learning" in text
    assert re.search(r"\| frozen \| 1: a \| [0-9.]+ \([0-9.]+x\) \|", text)


def test_tokens_per_step_counts_every_step_drafted_or_not() -> None:
    """64 tokens with 43 accepted drafts took 21 steps; plain decoding is 1.0; nothing is nan."""
    assert tokens_per_step([{"tokens": 64, "accepted": 43}]) == pytest.approx(64 / 21)
    assert tokens_per_step([{"tokens": 10, "accepted": 0}, {"tokens": 6, "accepted": 2}]) == pytest.approx(16 / 14)
    assert math.isnan(tokens_per_step([]))


def test_every_configuration_gets_its_own_colour() -> None:
    """Both panels of shift.png tell configurations apart: no two share a colour (suffix once drew
    in frozen's blue), sized vocabularies included."""
    names = ["plain", "frozen", "online", "no-learning", "suffix", "ngram", "vocab-static", "vocab-dynamic-lora",
             "vocab-static:6", "vocab-dynamic:6:2"]
    colors = config_colors(names)
    assert list(colors) == names and len(set(colors.values())) == len(names)
    assert colors["frozen"] == "tab:blue" and colors["plain"] == "tab:gray"


def test_a_trainer_catches_up_alone_after_its_configurations_turns(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--trainer-catchup-s``: after an online configuration's turn its trainer runs (unheld) while
    no configuration's loop runs, then is held again before the next configuration's turn."""
    from types import SimpleNamespace

    from tidespec.bench.shift import run as shift

    events: list[str] = []

    class Loop:
        def __init__(self, name: str) -> None:
            self.name = name

        def warm_up(self) -> None:
            events.append(f"warm {self.name}")

        def run_turn(self, end: int) -> None:
            events.append(f"turn {self.name} {end}")

        def finish(self) -> str:
            return self.name

    class Governor:
        def hold(self, held: bool) -> None:
            events.append("hold" if held else "release")

    monkeypatch.setattr(shift.time, "sleep", lambda s: events.append(f"alone {s:g}"))
    onlines = {"lora": SimpleNamespace(online=SimpleNamespace(governor=Governor()))}
    runs = shift._take_turns({"plain": Loop("plain"), "lora": Loop("lora")}, 4, 2, onlines, catchup_s=7.0)
    assert runs == {"plain": "plain", "lora": "lora"}
    assert events == ["hold", "warm plain", "warm lora",
                      "turn plain 2", "release", "turn lora 2", "alone 7", "hold",
                      "turn plain 4", "release", "turn lora 4", "alone 7", "hold"]
    with pytest.raises(ConfigError, match="trainer_catchup_s"):
        ShiftBenchConfig(trainer_catchup_s=-1.0)


def test_a_lora_trainer_learns_as_many_extra_tokens_as_the_engines_buffer_holds() -> None:
    from types import SimpleNamespace

    from tidespec.bench.shift.runs import lora_extra_vocab
    from tidespec.speculative.vocab.arc import ArcConfig
    from tidespec.speculative.vocab.dynamic import DynamicVocab, DynamicVocabConfig

    def engine(dynamic: bool) -> SimpleNamespace:
        cfg = DynamicVocabConfig(core_size=2, semantic_k=0, dynamic=dynamic, buffer=ArcConfig(capacity=24))
        vocab = DynamicVocab(cfg, [0, 1], lambda ids: torch.eye(8)[ids], start=False)
        return SimpleNamespace(drafter=SimpleNamespace(vocab=vocab))

    assert lora_extra_vocab(engine(True)) == 24  # vocab-dynamic(-lora), whatever sizes it named
    assert lora_extra_vocab(engine(False)) == 0  # vocab-static: nothing outside the core is drafted
    assert lora_extra_vocab(SimpleNamespace(drafter=SimpleNamespace(vocab=None))) == 0  # no draft vocabulary


def test_the_compile_flag_reaches_the_shift_bench(monkeypatch, tmp_path: Path) -> None:
    """``bench shift --compile`` compiles every configuration's step (the flag is the target's ``--compile``;
    it once parsed and was dropped)."""
    from tidespec.bench import cli as bench_cli
    from tidespec.cli import main

    seen: list[ShiftBenchConfig] = []
    monkeypatch.setattr(bench_cli, "run_shift_bench", lambda cfg, target, out, command="": seen.append(cfg))
    monkeypatch.setattr(bench_cli, "resolve_target", lambda *a: None)
    a = _workload(tmp_path / "a.jsonl", "a", 4, 10)
    for flags, compiled in (([], False), (["--compile"], True)):
        assert main(["bench", "shift", "--workloads", str(a), "--requests-per-phase", "2", *flags]) == 0
        assert seen.pop().compile is compiled
