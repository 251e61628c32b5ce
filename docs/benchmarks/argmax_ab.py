"""The runner's argmax of every verified row, ``torch.argmax`` against ``sampling.row_argmax``, in one process.

Builds plain, suffix alone and the per-sequence hybrid (suffix + the shipped EAGLE-3 head, analytic policy) twice each
on one target (w4a8 + compile), one of each pair with the runner's argmax as it was (``torch.argmax``: the
``-old`` rows), and runs them in turn per wave (as ``bench spec --hybrid`` does), so the machine's drift lands on
both sides alike; prints each one's tok/s against the new plain's and its outputs against plain's.

    PYTHONPATH=. .venv/bin/python docs/benchmarks/argmax_ab.py chat 16 1     # workload, prompts, batch size
"""
import argparse
import dataclasses
import types

from tidespec.bench.decode.run import bench_engine_config, wave_indices
from tidespec.bench.spec.waves import WaveRun, run_rounds, run_wave, warm_up, wave_target
from tidespec.config import ModelConfig, PolicyConfig, SpecConfig
from tidespec.engine.runner import ForwardOutput, ModelRunner
from tidespec.engine.scheduler import ScheduledBatch
from tidespec.llm import build_engine
from tidespec.sampling import SamplingParams
from tidespec.speculative.api import DraftProposal

ap = argparse.ArgumentParser()
ap.add_argument("workload")
ap.add_argument("limit", type=int)
ap.add_argument("batch", type=int)
ns = ap.parse_args()
mc = ModelConfig(quantization="w4a8", threads=2, compile=True)
target, prompts = wave_target(mc, None, ns.workload, ns.limit)


def torch_argmax_forward(self: ModelRunner, batch: ScheduledBatch, proposal: DraftProposal,
                         tap_layers: tuple[int, ...]) -> ForwardOutput:
    """``ModelRunner.forward`` with ``torch.argmax`` (the code before ``row_argmax``)."""
    plan = self.plan(batch, proposal)
    out = self.executor(plan.tokens, plan.q_lens, plan.ctx_lens, plan.slots, plan.logits_rows, plan.depths,
                        plan.masks, tap_layers, prefill=bool(batch.prefill))
    argmax = out.logits.argmax(-1).tolist() if out.logits is not None else []
    return ForwardOutput(plan.rows, out.logits, argmax, out.taps if tap_layers else None, out.last_hidden)


runs = []
for label, drafter in (("plain", "none"), ("plain-old", "none"), ("suffix", "suffix"), ("suffix-old", "suffix"),
                       ("perseq", "suffix,eagle3"), ("perseq-old", "suffix,eagle3")):
    spec = dataclasses.replace(SpecConfig(), drafter=drafter, num_speculative_tokens=4 if drafter != "none" else 0)
    pc = PolicyConfig(name="analytic", per_sequence=True) if label.startswith("perseq") else PolicyConfig()
    econf = bench_engine_config(prompts, 128, ns.batch, target.model.cfg.max_position_embeddings, mc, None, spec, pc)
    engine = build_engine(econf, model=target.model, tokenizer=target.tokenizer)
    if label.endswith("-old"):
        engine.runner.forward = types.MethodType(torch_argmax_forward, engine.runner)  # type: ignore[method-assign]
    runs.append(WaveRun(label, ns.batch, engine))
for r in runs:
    warm_up(r, prompts, lambda _p: SamplingParams(max_tokens=8), wave_indices(len(prompts), ns.batch))


def each(run: WaveRun, wave: list[int]) -> None:
    run_wave(run, prompts, wave, lambda _p: SamplingParams(max_tokens=128))


run_rounds(runs, len(prompts), (ns.batch,), "argmax a/b", each, True)
plain = runs[0]
for r in runs:
    same = sum(r.outputs[i] == plain.outputs[i] for i in plain.outputs)
    print(f"{r.label}: {r.tokens / r.wall:.1f} tok/s, x plain {(r.tokens / r.wall) / (plain.tokens / plain.wall):.3f}, "
          f"outputs = plain {same}/{len(plain.outputs)}")
