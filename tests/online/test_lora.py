"""Online LoRA alignment (EvoSpec path B): the merge equals peft's adapted head, adapters are
validated, the curriculum and the replay gate do what the paper says, the trainer's aligner
learns from captured hidden states, and serving stays lossless across adapter swaps."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import logging
from pathlib import Path

import pytest
import torch

from tests.online.test_online import PROMPTS, drafter_cfg, make_engine, random_head, run
from tidespec.config import CollectionConfig, DraftVocabConfig, EngineConfig, OnlineTrainingConfig, SpecConfig
from tidespec.flags import add_dataclass_args, dataclass_from_args
from tidespec.models.eagle3.checkpoint import fresh_head, publish
from tidespec.models.eagle3.head import Eagle3Head
from tidespec.models.eagle3.lora import (
    ALL_TARGETS,
    TARGETS,
    WEIGHTS_NAME,
    AdapterError,
    adapter_dir,
    list_adapters,
    load_adapter,
    lora_parameters,
    merged_state,
    save_adapter,
    with_lora,
)
from tidespec.models.families.decoder import DecoderModel
from tidespec.models.target import output_matrix
from tidespec.online.serving.attach import OnlineConfig, attach_online_training
from tidespec.online.store import SignalShard, SignalStore
from tidespec.online.training.config import LoraAlignConfig, TrainerConfig, TrainerConfigError
from tidespec.online.training.data import segments_by_sequence
from tidespec.online.training.eagle3_train import SignalBatch as Batch
from tidespec.online.training.eagle3_train import SignalSegment, unroll
from tidespec.online.training.judge import HeadWalk
from tidespec.online.training.lora import (
    LoraAligner,
    anchor_rows,
    curriculum_loss,
    eligible_rows,
    topk_kl,
    with_target_topk,
)
from tidespec.sampling import SamplingParams
from tidespec.speculative.drafters.eagle3 import build_eagle3_drafter
from tidespec.speculative.drafters.eagle3_options import Eagle3Options


def adapted(head: Eagle3Head, seed: int, rank: int = 4, targets: tuple[str, ...] = TARGETS) -> Eagle3Head:
    """A ``with_lora`` copy of ``head`` whose adapters are random (B no longer zero)."""
    train = with_lora(copy.deepcopy(head), rank=rank, alpha=2.0 * rank, targets=targets)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in lora_parameters(train):
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.3)
    return train.eval()


def segment(model: DecoderModel, head: Eagle3Head, prompt: list[int], n: int = 12, topk: int = 6) -> SignalSegment:
    """A segment of ``prompt`` continued greedily to ``n`` tokens, with the target's taps and its
    exact top-k at every position (so every label is the target's greedy choice)."""
    from tests.online.test_online import full_taps
    from tidespec.models.kv.cache import KVCache
    from tidespec.models.layout import BatchLayout

    ids = list(prompt)
    while True:
        kv = KVCache.for_model(model.cfg, 1, 128, model.dtype)
        out = model(torch.tensor(ids), BatchLayout.build([len(ids)], [0], [0]), kv,
                    logits_rows=torch.arange(len(ids)))
        if len(ids) >= n:
            break
        ids.append(int(out.logits[-1].argmax()))
    top = out.logits.topk(topk, dim=-1)
    taps = full_taps(model, ids, head.cfg.tap_layers)
    n = len(ids) - 1
    return SignalSegment(taps[:n], torch.tensor(ids), None, 0, top.indices[:n], top.values[:n].float())


# -- model level: merge, files, validation -----------------------------------------------------


@pytest.mark.parametrize("layers,fusion,targets", [(1, "concat", TARGETS), (2, "gated", TARGETS),
                                                    (2, "concat", ALL_TARGETS), (1, "gated", ("k_proj", "down_proj"))])
def test_merged_adapter_computes_what_the_peft_head_computes(model: DecoderModel, layers: int, fusion: str,
                                                             targets: tuple[str, ...], tmp_path: Path) -> None:
    head = fresh_head(model.cfg, None, model.dtype, seed=3, num_layers=layers, fusion=fusion)
    fresh = with_lora(copy.deepcopy(head), rank=4, alpha=8.0, targets=targets)
    assert {n.split(".lora_")[0].rsplit(".", 1)[-1] for n, _ in fresh.named_parameters() if "lora_" in n} == \
        set(targets)
    assert all(not p.requires_grad for n, p in fresh.named_parameters() if "lora_" not in n)
    seg = segment(model, head, [5, 6, 7])
    embed = model.embed_tokens
    batch = Batch.collate([seg], head)
    base_logits = unroll(head, embed, batch, 3)
    for a, b in zip(unroll(fresh, embed, batch, 3), base_logits):  # B starts at zero: same function
        torch.testing.assert_close(a, b)
    train = adapted(head, seed=1, targets=targets)
    moved = unroll(train, embed, batch, 3)
    assert not torch.allclose(moved[0], base_logits[0])
    n = save_adapter(tmp_path, train, base_version=3, metrics={})
    ad = load_adapter(adapter_dir(tmp_path, 3, n), head.cfg)
    assert ad.targets == tuple(t for t in ALL_TARGETS if t in targets)
    served = copy.deepcopy(head)
    served.load_state_dict(merged_state(head.state_dict(), ad, head.cfg))
    for a, b in zip(unroll(served, embed, batch, 3), moved):
        torch.testing.assert_close(a, b)


def test_adapters_are_numbered_and_bad_ones_refused(model: DecoderModel, tmp_path: Path) -> None:
    head = fresh_head(model.cfg, None, model.dtype, seed=3)
    assert [save_adapter(tmp_path, adapted(head, s), base_version=2, metrics={"x": s}) for s in (1, 2)] == [1, 2]
    assert list_adapters(tmp_path, 2) == [1, 2] and list_adapters(tmp_path, 5) == []
    ad = load_adapter(adapter_dir(tmp_path, 2, 2), head.cfg)
    assert (ad.number, ad.base_version, ad.rank, ad.scaling, ad.metrics) == (2, 2, 4, 2.0, {"x": 2})
    other = fresh_head(model.cfg, None, model.dtype, seed=3, num_layers=2)
    with pytest.raises(AdapterError, match="does not fit"):
        load_adapter(adapter_dir(tmp_path, 2, 1), other.cfg)
    rank8 = adapted(head, 3, rank=8)
    d = adapter_dir(tmp_path, 2, save_adapter(tmp_path, rank8, 2, {}))
    (d / "adapter_config.json").write_text('{"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}')
    with pytest.raises(AdapterError, match="shape"):
        load_adapter(d, head.cfg)
    (d / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 8, "target_modules": ["q_proj", "lm_head"]}')
    with pytest.raises(AdapterError, match="subset of q_proj"):
        load_adapter(d, head.cfg)
    (d / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 8, "target_modules": ["q_proj", "o_proj"]}')
    with pytest.raises(AdapterError, match="does not fit"):  # the file holds v_proj, the config names o_proj
        load_adapter(d, head.cfg)
    (d / WEIGHTS_NAME).write_bytes((d / WEIGHTS_NAME).read_bytes()[:64])
    with pytest.raises(AdapterError, match="unreadable"):
        load_adapter(d, head.cfg)
    nan = adapted(head, 4)
    with torch.no_grad():
        lora_parameters(nan)[0][0, 0] = float("nan")
    with pytest.raises(AdapterError, match="non-finite"):
        load_adapter(adapter_dir(tmp_path, 2, save_adapter(tmp_path, nan, 2, {})), head.cfg)


# -- trainer side: loss, gate, aligner ----------------------------------------------------------


def test_topk_kl_is_zero_on_agreement_and_drops_tokens_outside_the_draft_vocabulary() -> None:
    t2d = torch.tensor([0, 1, -1, 2])  # target token 2 is outside the 3-token draft vocabulary
    top_ids = torch.tensor([[[3, 2, 0]]])  # [1, 1, 3]
    top_logits = torch.tensor([[[2.0, 9.0, 1.0]]])
    agree = torch.tensor([[[1.0, -1e4, 2.0]]])  # draft ids 0, 1, 2 <- target tokens 0, 1, 3
    kl, keep = topk_kl(agree, top_ids, top_logits, t2d, 1.0)
    assert bool(keep.all()) and abs(float(kl)) < 1e-6  # token 2 (logit 9) dropped from both sides
    kl, _ = topk_kl(torch.tensor([[[2.0, -5.0, 1.0]]]), top_ids, top_logits, t2d, 1.0)
    p = torch.softmax(torch.tensor([2.0, 1.0]), 0)
    q = torch.softmax(torch.tensor([2.0, -5.0, 1.0]), 0)[[2, 0]]  # the drafter's whole softmax, on the support
    assert abs(float(kl) - float((p * (p / q).log()).sum())) < 1e-6
    # mass off the support is error: draft id 1 (target 1, not in the top-k) taking half of q's mass
    # costs log 2 even though q's ratios on the support are p's
    half, _ = topk_kl(torch.tensor([[[1.0, 1.0 + torch.log(torch.tensor(1 + torch.e)).item(), 2.0]]]), top_ids,
                      top_logits, t2d, 1.0)
    assert abs(float(half) - float(torch.log(torch.tensor(2.0)))) < 1e-5
    _, keep = topk_kl(agree, torch.tensor([[[2, 2, 2]]]), top_logits, t2d, 1.0)
    assert not bool(keep.any())


def test_curriculum_weights_follow_eq_4(model: DecoderModel) -> None:
    """beta 0 weighs every unroll step 1; a huge beta keeps only step 1 (the rows' L_base > 0);
    in between the loss lies between the two."""
    head = adapted(fresh_head(model.cfg, None, model.dtype, seed=3), 5)
    seg = segment(model, head, [5, 6, 7])
    mask = [torch.ones(seg.num_positions, dtype=torch.bool)]
    embed = model.embed_tokens
    with torch.no_grad():
        flat, rows = curriculum_loss(head, embed, [seg], mask, 3, beta=0.0, temperature=1.0)
        only_first, _ = curriculum_loss(head, embed, [seg], mask, 3, beta=1e6, temperature=1.0)
        first, _ = curriculum_loss(head, embed, [seg], mask, 1, beta=0.0, temperature=1.0)
        mid, _ = curriculum_loss(head, embed, [seg], mask, 3, beta=0.3, temperature=1.0)
        none, zero_rows = curriculum_loss(head, embed, [seg], [torch.zeros_like(mask[0])], 3, 0.3, 1.0)
    assert rows > 0
    torch.testing.assert_close(only_first, first)
    assert float(first) < float(mid) < float(flat)
    assert zero_rows == 0 and float(none) == 0.0


def test_the_replay_gate_keeps_misses_and_divergent_rows_only(model: DecoderModel) -> None:
    head = fresh_head(model.cfg, None, model.dtype, seed=3)
    seg = segment(model, head, [5, 6, 7])
    embed = model.embed_tokens
    gated_all, usable = eligible_rows(head, embed, [seg], kl_threshold=1e9, temperature=1.0)
    gated = gated_all[0]  # misses only
    logits = unroll(head, embed, Batch.collate([seg], head), 1)[0][0]  # [N, Vd]
    labels, valid = seg.labels(1)
    misses = (head.draft_to_target(logits.argmax(-1)) != labels) & valid
    assert gated.tolist() == misses.tolist()
    everything = eligible_rows(head, embed, [seg], kl_threshold=-1.0, temperature=1.0)[0][0]
    assert everything.tolist() == valid.tolist() == usable[0].tolist()  # every labelled row diverges by more than -1


def test_anchor_rows_add_about_ratio_times_the_eligible_rows_from_the_usable_ones() -> None:
    gen = torch.Generator().manual_seed(0)
    usable = [torch.rand(400, generator=gen) < 0.9 for _ in range(4)]
    eligible = [u & (torch.rand(400, generator=gen) < 0.1) for u in usable]
    n_elig = sum(int(e.sum()) for e in eligible)
    assert [m.tolist() for m in anchor_rows(eligible, usable, 0.0, gen)] == [e.tolist() for e in eligible]
    every = anchor_rows(eligible, usable, 1e9, gen)
    assert [m.tolist() for m in every] == [u.tolist() for u in usable]
    mixed = anchor_rows(eligible, usable, 1.0, gen)
    for m, e, u in zip(mixed, eligible, usable):
        assert bool((m >= e).all()) and bool((m <= u).all())  # eligible kept, nothing unusable added
    added = sum(int(m.sum()) for m in mixed) - n_elig
    assert 0.7 * n_elig < added < 1.3 * n_elig


def capture_with_hidden(model: DecoderModel, tok, tmp_path: Path, prompts: list[list[int]]) -> OnlineConfig:
    cfg = OnlineConfig(publish_root=str(tmp_path / "drafter"), signal_dir=str(tmp_path / "signals"),
                       capture_capacity_rows=4096, capture_flush_rows=32, lora=True,
                       collection=CollectionConfig(force=True))
    publish(cfg.publish_root, random_head(model, 1), {})
    engine = make_engine(model, tok, build_eagle3_drafter(model, cfg.publish_root, cfg=drafter_cfg()), gamma=3)
    online = attach_online_training(engine, cfg, start=False)
    run(engine, prompts)
    online.close()
    return cfg


def test_captured_hidden_states_give_the_targets_exact_top_k(model: DecoderModel, tok, tmp_path: Path) -> None:
    cfg = capture_with_hidden(model, tok, tmp_path, PROMPTS[:2])
    shards = [SignalStore(cfg.signal_dir, 1 << 30).read(i.shard_id) for i in
              SignalStore(cfg.signal_dir, 1 << 30).list_shards()]
    assert shards and all(s.hidden is not None and s.hidden.shape[1] == model.cfg.hidden_size for s in shards)
    shard = with_target_topk(shards[0], output_matrix(model), 5)
    assert shard.topk_ids is not None
    # every row was verified greedily: the target's top-1 is the token that followed
    assert torch.equal(shard.topk_ids[:, 0], shard.next_token_ids)


def served_in_turn(model: DecoderModel, tok, tmp_path: Path) -> tuple[OnlineConfig, list[SignalShard], SignalStore]:
    """Shards captured from a few prompts, and an empty store to append them to one at a time (the
    rows as a serving engine would deliver them)."""
    prompts = [[5, 6, 7, 8, 5, 6, 7], [9, 10, 11, 9, 10], [12, 13, 14, 15, 16, 12, 13, 14], [3, 4, 5, 3, 4],
               [20, 21, 22, 20], [30, 31, 30, 31], [7, 7, 8, 8], [40, 41, 42]]
    cfg = capture_with_hidden(model, tok, tmp_path, prompts)
    src = SignalStore(cfg.signal_dir, 1 << 30)
    shards = [src.read(i.shard_id) for i in src.list_shards()]
    assert len(shards) >= 3
    return cfg, shards, SignalStore(tmp_path / "live", 1 << 30)


def test_the_aligner_learns_from_served_signals_and_publishes_only_a_better_adapter(
        model: DecoderModel, tok, tmp_path: Path) -> None:
    cfg, shards, live = served_in_turn(model, tok, tmp_path)
    base = random_head(model, 1)
    lcfg = LoraAlignConfig(enabled=True, rank=4, alpha=8.0, buffer_rows=8, steps=6, lr=5e-3, min_rows=8, topk=6,
                           judge_rows=16)
    aligner = LoraAligner(lcfg, live, cfg.publish_root, model.embed_tokens, output_matrix(model), gamma=3,
                          ttt_steps=3, max_segment_len=64)
    assert aligner.step(base, 1) is None  # nothing in the store yet
    live.append(shards[0])
    assert aligner.step(base, 1) is None  # trained on the first rows; judged only on rows served after them
    pending = aligner.pending
    assert pending is not None and pending.eligible_rows >= 8 and pending.seen_rows > pending.eligible_rows // 2
    assert pending.loss_after < pending.loss_before  # the adapters learned the buffered rows
    results = []
    for shard in shards[1:]:
        live.append(shard)
        result = aligner.step(base, 1)
        if result is not None:
            results.append(result)
    assert results and all(r.judged_rows >= 16 for r in results)
    published = [r.adapter for r in results if r.adapter is not None]
    assert list_adapters(cfg.publish_root, 1) == published
    assert all(r.adapted_accept_len > r.baseline_accept_len for r in results if r.adapter is not None)
    assert aligner.step(base, 1) is None  # nothing new in the store
    assert aligner.step(random_head(model, 2), 2) is None and aligner.base_version == 2  # a new version resets
    assert aligner.pending is None and not aligner.buffer


def test_an_update_is_judged_on_the_next_rows_against_the_head_served_meanwhile(
        model: DecoderModel, tok, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Test, then train: the rows that score an update arrived after it, and once an adapter is
    published it (not the base head) is what the next update has to beat."""
    from tidespec.online.training import lora

    cfg, shards, live = served_in_turn(model, tok, tmp_path)
    base = random_head(model, 1)
    lcfg = LoraAlignConfig(enabled=True, rank=4, alpha=8.0, buffer_rows=4, steps=2, min_rows=8, topk=6,
                           judge_rows=8)
    aligner = LoraAligner(lcfg, live, cfg.publish_root, model.embed_tokens, output_matrix(model), gamma=3,
                          ttt_steps=3, max_segment_len=64)
    scored: list[tuple[Eagle3Head, list[SignalSegment]]] = []
    base_score = [0.5]

    def score(head: Eagle3Head, segments: list[SignalSegment]) -> float:
        scored.append((head, segments))
        return 2.0 if head is aligner.head else base_score[0] if head is base else 1.0  # the adapted head wins

    def walk(head: Eagle3Head, embed: torch.nn.Module, segments: list[SignalSegment], gamma: int,
             block_rows: int) -> HeadWalk:
        x = score(head, segments)  # two equal sequences: every resample gives the point gain (a certain judgement)
        return HeadWalk(rows=1, blocks=[(1, x), (1, x)], groups=[0, 1], row_sum=0, row_count=0)  # type: ignore[list-item]

    monkeypatch.setattr(lora, "walk_head", walk)
    live.append(shards[0])
    assert aligner.step(base, 1) is None and aligner.pending is not None and aligner.served is base
    live.append(shards[1])
    result = aligner.step(base, 1)
    assert result is not None and result.adapter == 1 and aligner.pending is not None  # judged, then trained again
    rows = {(s.start_position, tuple(s.token_ids.tolist()))
            for segs in segments_by_sequence([with_target_topk(shards[1], output_matrix(model), 6)], 64).values()
            for s in segs}
    assert [h for h, _ in scored] == [base, aligner.head]
    for _, segments in scored:  # exactly the second shard's rows, none the update trained on
        assert {(s.start_position, tuple(s.token_ids.tolist())) for s in segments} == rows
    served = aligner.served
    assert served is not base and served is not aligner.head
    want = merged_state(base.state_dict(), load_adapter(adapter_dir(cfg.publish_root, 1, 1), base.cfg), base.cfg)
    merged = copy.deepcopy(base)
    merged.load_state_dict(want)
    seg = segments_by_sequence([with_target_topk(shards[2], output_matrix(model), 6)], 64)
    probe = [s for segs in seg.values() for s in segs]
    batch = Batch.collate(probe, merged)
    torch.testing.assert_close(unroll(served, model.embed_tokens, batch, 1)[0],
                               unroll(merged, model.embed_tokens, batch, 1)[0])  # the published adapter
    scored.clear()
    live.append(shards[2])
    result = aligner.step(base, 1)
    assert result is not None and scored[0][0] is served  # the next update must beat it, and the bare base
    assert [h for h, _ in scored] == [served, aligner.head, base] and result.adapter == 2 and not result.reset
    # the traffic goes back to where the base head is best: a zero adapter (the base) is published
    base_score[0] = 3.0
    live.append(shards[3] if len(shards) > 3 else shards[0])
    result = aligner.step(base, 1)
    assert result is not None and result.reset and result.adapter == 3 and aligner.served is base
    zero = load_adapter(adapter_dir(cfg.publish_root, 1, 3), base.cfg)
    assert all(not bool(t.any()) for n, t in zero.tensors.items() if "lora_B" in n)
    for name, t in merged_state(base.state_dict(), zero, base.cfg).items():  # the published a3 is the base head
        assert torch.equal(t, base.state_dict()[name])


def test_lora_options_are_validated_and_reach_the_trainer_child(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    import tidespec.online.serving.launch as process

    with pytest.raises(TrainerConfigError, match="lora_rank"):
        LoraAlignConfig(rank=0)
    with pytest.raises(TrainerConfigError, match="lora_beta"):
        LoraAlignConfig(beta=-1)
    with pytest.raises(TrainerConfigError, match="lora_replay_rows and lora_extra_vocab"):
        LoraAlignConfig(extra_vocab=-1)
    with pytest.raises(TrainerConfigError, match="lora_targets.*got q_proj, fc"):
        LoraAlignConfig(targets="q_proj, fc")
    assert LoraAlignConfig(targets="down_proj,q_proj").target_modules == ("q_proj", "down_proj")
    assert OnlineTrainingConfig().lora  # on by default: LoRA first, the whole head later
    assert not OnlineConfig.from_engine_config(EngineConfig(
        spec=SpecConfig(drafter="eagle3", options={"eagle3": Eagle3Options(dir=str(tmp_path / "r0"))}),
        online=OnlineTrainingConfig(enabled=True, lora=False))).lora  # --no-online-lora
    spec = SpecConfig(drafter="eagle3", options={"eagle3": Eagle3Options(dir=str(tmp_path / "root"))})
    online = OnlineConfig.from_engine_config(EngineConfig(spec=spec, online=OnlineTrainingConfig(enabled=True,
                                                                                                lora=True)))
    assert online.lora
    started: list[list[str]] = []
    monkeypatch.setattr(process.subprocess, "Popen", lambda cmd, **kw: started.append(cmd))
    process.start_trainer_process(online, None, log_path=tmp_path / "log")
    parser = argparse.ArgumentParser()  # the child parses them with the trainer's own flags
    add_dataclass_args(parser, TrainerConfig)
    parsed = dataclass_from_args(TrainerConfig, parser.parse_args(started[0][started[0].index("train-drafter") + 1:]))
    assert parsed.lora.enabled and parsed.lora.rank == 32 and parsed.lora.beta == 0.3
    assert parsed.lora.extra_vocab == 0  # no dynamic draft vocabulary: the head's own tokens only
    dynamic = dataclasses.replace(spec, vocab=DraftVocabConfig(mode="dynamic", buffer=64))
    online = OnlineConfig.from_engine_config(EngineConfig(spec=dynamic, online=OnlineTrainingConfig(enabled=True,
                                                                                                   lora=True)))
    process.start_trainer_process(online, None, log_path=tmp_path / "log")
    parsed = dataclass_from_args(TrainerConfig, parser.parse_args(started[1][started[1].index("train-drafter") + 1:]))
    assert parsed.lora.extra_vocab == 64  # the adapters learn the tokens the buffer can hold


# -- serving: lossless swaps, refusals ----------------------------------------------------------


@pytest.fixture(scope="module")
def plain(model: DecoderModel, tok) -> list[list[int]]:
    return run(make_engine(model, tok), PROMPTS)[0]


def serving_with_lora(model: DecoderModel, tok, tmp_path: Path, tree: bool = False, rollback_min_drafts: int = 64,
                      quantization: str = "none"):
    """(config, base head, drafter, engine, OnlineTraining): serving version 1 with --online-lora, no pollers."""
    cfg = OnlineConfig(publish_root=str(tmp_path / "drafter"), signal_dir=str(tmp_path / "signals"), lora=True,
                       capture_capacity_rows=2048, capture_flush_rows=64, collection=CollectionConfig(force=True),
                       rollback_min_drafts=rollback_min_drafts)
    base = random_head(model, 1)
    publish(cfg.publish_root, base, {})
    drafter = build_eagle3_drafter(model, cfg.publish_root, cfg=dataclasses.replace(drafter_cfg(),
                                                                                   quantization=quantization))
    engine = make_engine(model, tok, drafter, gamma=4, tree=tree)
    return cfg, base, drafter, engine, attach_online_training(engine, cfg, start=False)


@pytest.mark.parametrize("tree,batch,quantization", [(False, 4, "none"), (True, 4, "none"), (False, 1, "int8")])
def test_greedy_equals_plain_across_adapter_swaps(model: DecoderModel, tok, plain: list[list[int]], tmp_path: Path,
                                                  tree: bool, batch: int, quantization: str) -> None:
    """int8: the poller quantizes each merged adapter's drafting copy; the engine thread only installs it."""
    cfg, base, drafter, engine, online = serving_with_lora(model, tok, tmp_path, tree, quantization=quantization)
    ads = online.adapters
    assert ads is not None
    prepared: list[object] = []
    real_prepare = drafter.prepare
    drafter.prepare = lambda *a, **k: prepared.append(real_prepare(*a, **k)) or prepared[-1]  # type: ignore[method-assign]
    heads = [adapted(base, s) for s in (1, 2)]

    def between(step: int) -> None:
        if step in (3, 7):  # mid-generation: an adapter appears; the poller asks for the base, then parks it
            save_adapter(cfg.publish_root, heads[step // 7], base_version=1, metrics={})
        if step == 4:
            assert ads.poll_once() is None  # first time: the engine thread copies the clean base
        if step == 5:
            assert ads.poll_once() == 1
        if step == 8:
            assert ads.poll_once() == 2  # the clean base is kept: parked at once

    outs, drafted = run(engine, PROMPTS[:batch], between=between)
    assert outs == plain[:batch] and drafted > 0
    assert online.state()["lora"]["adapter"] == 2 and ads.num_swaps == 2 and drafter.version == 1
    want = merged_state(base.state_dict(), load_adapter(adapter_dir(cfg.publish_root, 1, 2), base.cfg), base.cfg)
    for name, t in drafter.head.state_dict().items():
        torch.testing.assert_close(t, want[name])
    assert len(prepared) == 2 and (drafter.served is prepared[-1] if quantization != "none" else
                                   drafter.served is drafter.head and prepared == [None, None])
    online.close()


def test_a_corrupt_adapter_is_refused_and_serving_continues(model: DecoderModel, tok, plain: list[list[int]],
                                                            tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cfg, base, drafter, engine, online = serving_with_lora(model, tok, tmp_path)
    ads = online.adapters
    assert ads is not None
    d = adapter_dir(cfg.publish_root, 1, save_adapter(cfg.publish_root, adapted(base, 1), 1, {}))
    (d / WEIGHTS_NAME).write_bytes(b"not a safetensors file")
    assert ads.poll_once() is None
    engine.step()  # between steps: the base is copied
    with caplog.at_level(logging.WARNING, logger="tidespec.online.serving.adapters"):
        assert ads.poll_once() is None and ads.poll_once() is None  # refused once, not re-read unchanged
    assert len([r for r in caplog.records if "refusing LoRA adapter" in r.getMessage()]) == 1
    assert online.state()["lora"]["refused_adapters"] == ["v1/a1"]
    outs, _ = run(engine, PROMPTS)
    assert outs == plain and ads.applied == 0
    online.close()


def test_adapters_follow_the_served_version(model: DecoderModel, tok, tmp_path: Path) -> None:
    """An adapter of another version is never applied; a new version starts without adapters."""
    cfg, base, drafter, engine, online = serving_with_lora(model, tok, tmp_path)
    ads = online.adapters
    assert ads is not None
    save_adapter(cfg.publish_root, adapted(base, 1), base_version=7, metrics={})
    assert ads.poll_once() is None
    save_adapter(cfg.publish_root, adapted(base, 2), base_version=1, metrics={})
    ads.poll_once()
    engine.step()
    assert ads.poll_once() == 1
    engine.step()
    assert ads.applied == 1
    publish(cfg.publish_root, random_head(model, 2), {})
    assert online.updater.poll_once() == 2
    engine.step()
    engine.step()
    assert drafter.version == 2 and ads.applied == 0 and ads.poll_once() is None
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    engine.add_request(PROMPTS[0], params)
    while engine.has_unfinished_requests():
        engine.step()
    online.close()


def test_the_trainer_aligns_between_rounds_from_where_its_rounds_stand(model: DecoderModel, tok,
                                                                       tmp_path: Path) -> None:
    from tidespec.online.training.rounds import DraftTrainer

    cfg = capture_with_hidden(model, tok, tmp_path, PROMPTS + [[20, 21, 22, 20], [30, 31, 30, 31]])
    lcfg = LoraAlignConfig(enabled=True, rank=4, alpha=8.0, buffer_rows=4, steps=2, min_rows=4, topk=6)
    tcfg = TrainerConfig(signal_dir=cfg.signal_dir, publish_root=cfg.publish_root, min_signals=1 << 20,
                         heldout_frac=0.25, lora=lcfg, progress=False)
    with pytest.raises(TrainerConfigError, match="--lora needs the target"):
        DraftTrainer(tcfg, model.cfg, model.embed_tokens)
    trainer = DraftTrainer(tcfg, model.cfg, model.embed_tokens, target=model)
    assert trainer.run_round() is None  # far fewer rows than a full round needs
    assert trainer.align() and not trainer.align()  # read the new rows once
    assert trainer.aligner is not None and trainer.aligner.base_version == 1
    assert trainer.aligner.pending is not None and not trainer.aligner.results  # updated; judged on later rows



def test_the_aligner_waits_for_a_trained_head(model: DecoderModel, tok, tmp_path: Path) -> None:
    """Nothing published and no --init-from: the head is random and adapters on it cannot make it
    draft; alignment starts on the first published version, with the rows it finds then."""
    from tidespec.online.training.rounds import DraftTrainer

    cfg = capture_with_hidden(model, tok, tmp_path, PROMPTS)
    empty = tmp_path / "empty"
    lcfg = LoraAlignConfig(enabled=True, rank=4, alpha=8.0, buffer_rows=4, steps=2, min_rows=4, topk=6)
    tcfg = TrainerConfig(signal_dir=cfg.signal_dir, publish_root=str(empty), min_signals=1 << 20,
                         heldout_frac=0.25, lora=lcfg, progress=False)
    trainer = DraftTrainer(tcfg, model.cfg, model.embed_tokens, target=model)
    assert trainer.run_round() is None and not trainer.align()
    assert trainer.aligner is not None and trainer.aligner.head is None and trainer.aligner.cursor is None
    publish(empty, random_head(model, 1), {})
    assert trainer.align() and trainer.aligner.base_version == 1


def test_a_version_rolled_back_to_takes_its_newest_adapter_on_its_clean_weights(model: DecoderModel, tok,
                                                                                tmp_path: Path) -> None:
    """v1 + a1 served, v2 swapped in, then v1's weights (with a1 merged, as a rollback restores them)
    come back: a1 is merged again into v1's kept clean copy, never on top of itself."""
    cfg, base, drafter, engine, online = serving_with_lora(model, tok, tmp_path, rollback_min_drafts=0)
    ads = online.adapters
    assert ads is not None
    save_adapter(cfg.publish_root, adapted(base, 1), base_version=1, metrics={})
    ads.poll_once()
    engine.step()
    assert ads.poll_once() == 1
    engine.step()
    served_v1 = {k: v.clone() for k, v in drafter.head.state_dict().items()}
    publish(cfg.publish_root, random_head(model, 2), {})
    assert online.updater.poll_once() == 2
    engine.step()
    assert drafter.version == 2 and ads.applied == 0
    drafter.load_state(1, served_v1)  # what a rollback does: the previous head state, adapter included
    engine.step()
    assert ads.poll_once() == 1
    engine.step()
    assert ads.applied == 1
    want = merged_state(base.state_dict(), load_adapter(adapter_dir(cfg.publish_root, 1, 1), base.cfg), base.cfg)
    for name, t in drafter.head.state_dict().items():
        torch.testing.assert_close(t, want[name])
    online.close()


def test_full_rounds_distil_from_the_top_k_of_captured_hidden_states(model: DecoderModel, tok, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from tidespec.online.training import rounds

    cfg = capture_with_hidden(model, tok, tmp_path, PROMPTS)
    seen: list[bool] = []
    inner = rounds.ttt_loss

    def spy(head, embed, segments, *args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(all(s.topk_ids is not None for s in segments))
        return inner(head, embed, segments, *args, **kwargs)

    monkeypatch.setattr(rounds, "ttt_loss", spy)
    tcfg = TrainerConfig(signal_dir=cfg.signal_dir, publish_root=cfg.publish_root, heldout_frac=0.25, max_steps=2,
                         progress=False, lora=LoraAlignConfig(topk=5))
    trainer = rounds.DraftTrainer(tcfg, model.cfg, model.embed_tokens, target=model)
    assert trainer.run_round(min_signals=1) is not None
    assert seen and all(seen)  # every training step saw the target's top-k
    seen.clear()
    blind = rounds.DraftTrainer(dataclasses.replace(tcfg, publish_root=str(tmp_path / "other")), model.cfg,
                                model.embed_tokens)  # without the target: hard labels, as before
    assert blind.run_round(min_signals=1) is not None
    assert seen and not any(seen)
