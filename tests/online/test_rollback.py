"""Deploy only what pays in service: the served check after a swap, hand-traced, and a deliberately
worse published version swapped back out by a serving engine within N = ``min_drafts`` steps."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers import run_to_completion, tiny_tokenizer
from tests.speculative.test_eagle3 import _greedy_generations, tiny_target
from tidespec.config import CacheConfig, EngineConfig, SpecConfig
from tidespec.engine.engine import LLMEngine
from tidespec.models.eagle3.checkpoint import fresh_head, publish
from tidespec.models.eagle3.head import Eagle3Config, Eagle3Head
from tidespec.online.serving.attach import DrafterUpdater
from tidespec.online.serving.rollback import RollbackConfig, ServedCheck
from tidespec.online.training.eagle3_train import Eagle3TrainConfig, Eagle3Trainer
from tidespec.sampling import SamplingParams
from tidespec.speculative.drafters.eagle3 import Eagle3DrafterConfig, build_eagle3_drafter
from tidespec.speculative.policy.speedup import Profile
from tidespec.stats import StepStats

PROFILE = Profile(target_latency={1: 0.010, 4: 0.011, 8: 0.012, 64: 0.05}, draft_cost={"default": 0.0005})


def _step(outcomes: list[tuple[int, int, int]], batch: int = 1) -> StepStats:
    return StepStats(num_decode_seqs=batch, drafter_outcomes={"eagle3": outcomes})


def test_served_check_hand_traced() -> None:
    """Old version: 300 accepted, 200 rejections (alpha 0.6); new: 50 and 64 (alpha 0.44) -> the
    served speedup at batch 1 falls (eq. 5), so: roll back; a new version as good as the old: keep."""
    check = ServedCheck(PROFILE, RollbackConfig(min_drafts=64, history=512, margin=0.02, gamma_max=4))
    for _ in range(200):
        check.on_step_end(_step([(4, 4, 1)]))  # a rejection after 1 accepted
    for _ in range(25):
        check.on_step_end(_step([(4, 4, 4)]))
    check.on_step_end(_step([(4, 0, 0)]))  # no draft: not counted
    assert check.verdict() is None  # nothing swapped yet
    check.swapped(1, {}, Eagle3Config.for_target(tiny_target().cfg))
    for _ in range(50):
        check.on_step_end(_step([(4, 2, 1)]))
    assert check.verdict() is None  # 50 < min_drafts
    for _ in range(14):
        check.on_step_end(_step([(4, 1, 0)]))
    assert check.previous is not None
    assert check.previous.record.alpha() == pytest.approx(0.6) and check.current.alpha() == pytest.approx(50 / 114)
    assert check.verdict() == "rollback" and "vs" in str(check.last_verdict)
    assert check.served_speedup(check.current) < check.served_speedup(check.previous.record)
    check.current.drafts.clear()
    for _ in range(64):
        check.on_step_end(_step([(4, 4, 1)] * 4 + [(4, 4, 4)]))
    assert check.verdict() == "keep"


def test_a_worse_published_version_is_swapped_back_out(tmp_path: Path) -> None:
    """Version 1 is a head trained on the target's own generations of the served prompts; version 2,
    published while serving, is a fresh random head. One sequence drafts every step, so the check
    decides after N = min_drafts = 24 steps of version 2 and swaps version 1 back in; outputs stay
    those of plain decoding."""
    target = tiny_target(torch.float32, seed=0, vocab=64)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 64, (4,), generator=gen).tolist() for _ in range(4)]
    segs = _greedy_generations(target, prompts, 28)
    torch.manual_seed(1)
    good = Eagle3Head(Eagle3Config.for_target(target.cfg))
    trainer = Eagle3Trainer(good, target.embed_tokens, Eagle3TrainConfig(lr=3e-3, ttt_steps=3))
    for _ in range(110):
        trainer.step(segs)
    root = tmp_path / "drafter"
    publish(root, good.eval(), {"note": "good"})
    cfg = EngineConfig(cache=CacheConfig(max_model_len=64, max_num_seqs=1),
                       spec=SpecConfig(drafter="eagle3", num_speculative_tokens=3))
    drafter = build_eagle3_drafter(target, root, 0, Eagle3DrafterConfig(max_num_seqs=1, max_model_len=64))
    assert drafter.version == 1
    engine = LLMEngine(target, tiny_tokenizer(64), cfg, drafter=drafter)
    check = ServedCheck(None, RollbackConfig(min_drafts=24, history=128, gamma_max=3))
    updater = DrafterUpdater(drafter, root, target.cfg, check=check)
    engine.add_observer(check)
    engine.add_observer(updater)
    versions: list[int] = []
    outputs: list[list[int]] = []
    plain = LLMEngine(target, tiny_tokenizer(64), EngineConfig(cache=CacheConfig(max_model_len=64, max_num_seqs=1)))
    expected = []
    for p in prompts * 2:
        plain.add_request(p, SamplingParams(max_tokens=28, ignore_eos=True))
        expected.append(run_to_completion(plain).popitem()[1].token_ids)
    for k, p in enumerate(prompts * 2):
        if k == 2:  # version 2 appears while serving
            publish(root, fresh_head(target.cfg, None, torch.float32), {"note": "worse"})
            assert updater.poll_once() == 2
        engine.add_request(p, SamplingParams(max_tokens=28, ignore_eos=True))
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    outputs.append(o.token_ids)
            versions.append(drafter.version)
    served_v2 = versions.count(2)
    # swapped in, and out again after N = 24 drafting steps (+ at most 2 prefill steps, which draft nothing)
    assert 24 <= served_v2 <= 24 + 2
    assert versions[-1] == 1 and check.rollbacks == 1 and 2 in updater.refused
    assert updater.poll_once() is None  # the refused version is not loaded again
    assert outputs == expected  # lossless throughout

    # a trainer's revert (its own paired judgement, published as a new version) is final: served
    # past the check's N drafts, even a worse head is not swapped back
    publish(root, fresh_head(target.cfg, None, torch.float32), {"reverts": 2, "restores": 1})
    assert updater.poll_once() == 3
    reverted: list[int] = []
    for p in prompts * 2:
        engine.add_request(p, SamplingParams(max_tokens=28, ignore_eos=True))
        out = run_to_completion(engine)
        reverted.append(drafter.version)
        assert out.popitem()[1].token_ids == expected[len(reverted) - 1]
    assert reverted[-1] == 3 and check.rollbacks == 1 and 3 not in updater.refused
