"""What capturing training signals costs a step that does not draft: EAGLE-3 alone under the analytic policy (parked
where it does not pay), with online capture attached at ``--capture-idle-share S`` (forced collection, LoRA's final
hidden states kept, no trainer child) against the same engine without capture, prompt by prompt in one process.

Prints per engine the tok/s, the rows captured, and the median time of the no-draft steps with and without the
target's taps (and of their Python outside the forward).

    PYTHONPATH=. .venv/bin/python docs/benchmarks/idle_capture_cost.py zh_topics 12 0.25 [QUANTIZATION [COMPILE]]

(QUANTIZATION: w4a8 by default, with --compile unless COMPILE is 0; a CPU without AVX512-VNNI runs "none 0".)
"""
import statistics
import sys
import tempfile
from pathlib import Path

from tidespec.bench.decode.run import bench_engine_config, wave_indices
from tidespec.bench.shift.runs import learned_engine, seed_publish_root
from tidespec.bench.spec.waves import WaveRun, run_wave, warm_up, wave_target
from tidespec.config import CollectionConfig, ModelConfig, PolicyConfig, SpecConfig
from tidespec.online.serving.attach import OnlineConfig, OnlineTraining, attach_online_training
from tidespec.sampling import SamplingParams
from tidespec.stats import StepStats

SHIPPED = "tidespec/assets/eagle3-smollm2-135m-instruct"
workload, limit, share = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
quantization = sys.argv[4] if len(sys.argv) > 4 else "w4a8"
mc = ModelConfig(quantization=quantization, threads=2, compile=len(sys.argv) <= 5 or sys.argv[5] != "0")
target, prompts = wave_target(mc, None, workload, limit)
work = Path(tempfile.mkdtemp(prefix="tidespec-idle-capture-"))
runs: list[tuple[WaveRun, OnlineTraining | None, list[StepStats]]] = []
for label, capture in (("no capture", False), (f"capture, idle share {share}", True)):
    root = work / str(len(runs)) / "drafter"
    seed_publish_root(root, SHIPPED, target.model, "eagle3")
    spec = SpecConfig(drafter="eagle3", num_speculative_tokens=4)
    econf = bench_engine_config(prompts, 128, 1, target.model.cfg.max_position_embeddings, mc, None, spec,
                                PolicyConfig(name="analytic"))
    engine = learned_engine(target.model, target.tokenizer, econf, root, 8192)
    run = WaveRun(label, 1, engine)
    warm_up(run, prompts, lambda _p: SamplingParams(max_tokens=8), wave_indices(len(prompts), 1))
    online = attach_online_training(engine, OnlineConfig(
        publish_root=str(root), signal_dir=str(root.parent / "signals"), capture_idle_share=share, lora=True,
        collection=CollectionConfig(force=True)), start=False) if capture else None
    engine.history.clear()
    runs.append((run, online, []))
for i in range(len(prompts)):
    for run, _, steps in runs:
        run_wave(run, prompts, [i], lambda _p: SamplingParams(max_tokens=128))
        steps += [s for s in run.engine.history if s.num_decode_seqs == 1 and not s.num_prefill_tokens]
        run.engine.history.clear()
for run, online, steps in runs:
    captured = online.capture.stats()["num_captured"] if online is not None else 0
    print(f"{run.label}: {run.tokens / run.wall:.1f} tok/s, {len(steps)} decode steps, {captured} rows captured")
    for tapped in (False, True):
        group = [s for s in steps if s.num_drafts == 0 and bool(s.taps) == tapped]
        if group:
            print(f"  no-draft steps {'with' if tapped else 'without'} taps: {len(group)}, median "
                  f"{1000 * statistics.median(s.total_time for s in group):.3f} ms, of which outside the forward "
                  f"{1000 * statistics.median(s.other_time for s in group):.3f} ms")
