"""Record the analytic policy's inputs in a real run, then replay them into fresh policies: same decisions? how fast?

``record`` runs one configuration (eager w4a8, batch B) over a workload and pickles every ``PlanInput`` and
``StepStats`` its policy saw, with the policy's options. ``replay`` feeds them, in order, to a policy built afresh
(``make_policy`` with those options, the code on ``PYTHONPATH``), ``REPEATS`` times, and prints the best time per
step of planning (with the engine's ``probe_due`` / ``priced_out`` questions) and of observing, and a digest of every
plan: a change to the policy's code that keeps the digest makes the same decisions on that run.

    PYTHONPATH=. .venv/bin/python docs/benchmarks/policy_replay.py record chat 8 suffix,eagle3 /tmp/ctrl.pkl
    PYTHONPATH=. .venv/bin/python docs/benchmarks/policy_replay.py replay /tmp/ctrl.pkl 20
"""
import copy
import dataclasses
import hashlib
import pickle
import sys
import time
from typing import Any

from tidespec.speculative.policy import api as policy_api
from tidespec.speculative.policy.factory import PolicyOptions, make_policy
from tidespec.speculative.policy.speedup import Profile


def record(workload: str, limit: int, drafter: str, out: str, batch: int = 1) -> None:
    from tidespec.bench.decode.run import bench_engine_config
    from tidespec.bench.spec.waves import WaveRun, run_wave, warm_up, wave_target
    from tidespec.config import ModelConfig, PolicyConfig, SpecConfig
    from tidespec.llm import build_engine
    from tidespec.sampling import SamplingParams

    mc = ModelConfig(quantization="w4a8", threads=2)
    target, prompts = wave_target(mc, None, workload, limit)
    spec = dataclasses.replace(SpecConfig(), drafter=drafter, num_speculative_tokens=4)
    econf = bench_engine_config(prompts, 128, batch, target.model.cfg.max_position_embeddings, mc, None, spec,
                                PolicyConfig(name="analytic"))
    engine = build_engine(econf, model=target.model, tokenizer=target.tokenizer)
    run = WaveRun("recorded", batch, engine)
    warm_up(run, prompts, lambda _p: SamplingParams(max_tokens=8))
    guards: Any = engine.policy
    policy = guards.inner
    options = {"gamma_max": policy.gamma_max, "profile": policy.profile.to_dict(), "guards": guards.config,
               "drafters": tuple(d for d in policy.drafters if d is not None) if policy.multi else (),
               "shadowed": policy.shadowed}
    events: list[tuple[str, Any]] = []
    plan, observe = guards.plan_drafters, guards.observe

    def recorded_plan(inp: Any) -> Any:
        events.append(("plan", copy.deepcopy(inp)))
        return plan(inp)

    def recorded_observe(step: Any) -> None:
        events.append(("observe", copy.deepcopy(step)))
        observe(step)
    guards.plan_drafters, guards.observe = recorded_plan, recorded_observe
    for i in range(0, len(prompts), batch):
        run_wave(run, prompts, list(range(i, min(i + batch, len(prompts)))),
                 lambda _p: SamplingParams(max_tokens=128))
    with open(out, "wb") as f:
        pickle.dump((options, events), f)
    print(f"{len(events)} events recorded to {out}")


def replay(path: str, repeats: int) -> None:
    with open(path, "rb") as f:
        options, events = pickle.load(f)
    best: tuple[float, float] | None = None
    digest = ""
    for _ in range(repeats):
        policy = make_policy("analytic", PolicyOptions(
            gamma_max=options["gamma_max"], profile=Profile.from_dict(options["profile"]),
            drafters=options["drafters"], shadowed=options["shadowed"], guards=options["guards"]))
        planning = observing = 0.0
        decisions = []
        for kind, item in events:
            t = time.perf_counter()
            if kind == "plan":
                choice = policy.plan_drafters(item)
                asked = policy_api.probe_due(policy, "eagle3"), policy_api.priced_out(policy, "eagle3")
                planning += time.perf_counter() - t
                decisions.append((tuple(sorted(choice.items())), asked))
            else:
                policy.observe(item)
                observing += time.perf_counter() - t
        digest = hashlib.sha1(repr(decisions).encode()).hexdigest()[:12]
        if best is None or planning + observing < sum(best):
            best = (planning, observing)
    assert best is not None
    plans = sum(kind == "plan" for kind, _ in events)
    print(f"{path}: {plans} plans; plan {1e6 * best[0] / plans:.1f} us, observe {1e6 * best[1] / plans:.1f} us per "
          f"step (best of {repeats}); decisions digest {digest}")


if __name__ == "__main__":
    if sys.argv[1] == "record":
        record(sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5], int(sys.argv[6]) if len(sys.argv) > 6 else 1)
    else:
        replay(sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 20)
