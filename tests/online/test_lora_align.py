"""LoRA alignment's data: over a dynamic draft vocabulary the adapters of a pruned head are trained
and judged on the tokens outside its vocabulary that the target emitted (``LoraAlignConfig.extra_vocab``),
drafted through calibrated rows, and still serve the narrow head; a replay window
(``replay_rows``) keeps earlier updates' rows in training."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.online.test_lora import segment, served_in_turn
from tests.online.test_online import random_head
from tidespec.models.eagle3.head import Eagle3Head
from tidespec.models.eagle3.lora import adapter_dir, list_adapters, load_adapter, merged_state
from tidespec.models.families.decoder import DecoderModel
from tidespec.models.target import output_matrix
from tidespec.online.store import SignalStore
from tidespec.online.training import lora
from tidespec.online.training.config import LoraAlignConfig, TrainerConfigError
from tidespec.online.training.eagle3_train import SignalBatch, unroll
from tidespec.online.training.lora import LoraAligner, eligible_rows, extra_vocab

OWN = 24  # the pruned heads' draft vocabulary: target ids 0..23


def pruned_head(model: DecoderModel, seed: int = 3) -> Eagle3Head:
    return random_head(model, seed, OWN)


def test_the_widened_vocabulary_holds_inside_the_block_only(model: DecoderModel) -> None:
    head = pruned_head(model)
    embed, rows_of = model.embed_tokens, output_matrix(model)
    seg = segment(model, head, [30, 31, 32])
    batch = SignalBatch.collate([seg], head)
    narrow = unroll(head, embed, batch, 2)
    outside = torch.tensor([40, 25, 33])
    rows = head.output_rows(outside, rows_of)  # [3, H] calibrated
    with extra_vocab(head, outside, rows) as wide:
        logits = unroll(wide, embed, batch, 2)
        assert logits[0].shape[-1] == OWN + 3
        torch.testing.assert_close(logits[0][..., :OWN], narrow[0])  # step 1: the own columns unchanged
        assert wide.draft_to_target(torch.arange(OWN, OWN + 3)).tolist() == outside.tolist()
        assert wide.target_to_draft()[outside].tolist() == [OWN, OWN + 1, OWN + 2]
        assert not any(p.requires_grad for p in wide.lm_head.parameters())
    assert head.cfg.draft_vocab_size == OWN and head.lm_head.weight.shape[0] == OWN
    assert head.target_to_draft()[outside].tolist() == [-1, -1, -1]
    for a, b in zip(unroll(head, embed, batch, 2), narrow):
        torch.testing.assert_close(a, b)
    # rows outside the own vocabulary become usable for the replay gate inside the block only
    _, usable = eligible_rows(head, embed, [seg], 0.5, 1.0)
    with extra_vocab(head, torch.arange(OWN, model.cfg.vocab_size),
                     head.output_rows(torch.arange(OWN, model.cfg.vocab_size), rows_of)) as wide:
        _, usable_wide = eligible_rows(wide, embed, [seg], 0.5, 1.0)
    labels, valid = seg.labels(1)
    assert usable_wide[0].tolist() == (valid & (labels >= 0)).tolist()
    assert usable[0].tolist() == (valid & (labels < OWN)).tolist()


def test_the_aligner_learns_emitted_tokens_outside_the_head_and_publishes_narrow_adapters(
        model: DecoderModel, tok, tmp_path: Path) -> None:
    _, shards, live = served_in_turn(model, tok, tmp_path)
    base = pruned_head(model, 1)
    common = {"enabled": True, "rank": 4, "alpha": 8.0, "buffer_rows": 8, "steps": 6, "lr": 5e-3, "min_rows": 8,
              "topk": 6, "judge_rows": 16, "min_coverage": 0.0}
    seen: set[int] = set()
    for s in shards:
        seen.update(t for t in s.token_ids.tolist() if t >= OWN)
    assert seen  # the captured traffic holds tokens outside the pruned vocabulary
    pending = {}
    for extra in (0, 4, 512):
        live = type(live)(tmp_path / f"live{extra}", 1 << 30)
        root = tmp_path / f"root{extra}"
        aligner = LoraAligner(LoraAlignConfig(**common, extra_vocab=extra), live, root, model.embed_tokens,
                              output_matrix(model), gamma=3, ttt_steps=3, max_segment_len=64)
        live.append(shards[0])
        aligner.step(base, 1)
        assert len(aligner.recent) <= extra and set(aligner.recent) <= seen
        pending[extra] = aligner.pending
        for shard in shards[1:]:
            live.append(shard)
            aligner.step(base, 1)
        assert base.cfg.draft_vocab_size == OWN and aligner.head.cfg.draft_vocab_size == OWN
        for n in list_adapters(root, 1):  # every published adapter merges into the narrow head
            merged = merged_state(base.state_dict(), load_adapter(adapter_dir(root, 1, n), base.cfg), base.cfg)
            assert merged["lm_head.weight"].shape[0] == OWN
    assert pending[0] is not None and pending[512] is not None
    assert pending[512].eligible_rows > pending[0].eligible_rows  # rows labelled outside the head now count


def test_the_replay_window_keeps_earlier_rows_in_training(model: DecoderModel, tok, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    _, shards, live = served_in_turn(model, tok, tmp_path)
    base = pruned_head(model, 1)
    steps: list[set[tuple[int, tuple[int, ...]]]] = []  # per update: the rows it trained on beyond its buffer
    real_loss, real_update = lora.curriculum_loss, LoraAligner._update
    buffer: set[tuple[int, tuple[int, ...]]] = set()

    def key(seg) -> tuple[int, tuple[int, ...]]:
        return seg.start_position, tuple(seg.token_ids.tolist())

    def loss_spy(head, embed, segments, masks, *args):
        if head.training:
            steps[-1].update(key(s) for s in segments if key(s) not in buffer)
        return real_loss(head, embed, segments, masks, *args)

    def update_spy(self, buffered):
        buffer.clear()
        buffer.update(key(s) for s, _, _ in self.buffer)
        steps.append(set())
        return real_update(self, buffered)

    monkeypatch.setattr(lora, "curriculum_loss", loss_spy)
    monkeypatch.setattr(LoraAligner, "_update", update_spy)
    windows = {}
    for replay in (0, 40):
        steps.clear()
        cfg = LoraAlignConfig(enabled=True, rank=4, alpha=8.0, buffer_rows=4, steps=2, min_rows=8, topk=6,
                              judge_rows=8, replay_rows=replay, min_coverage=0.0)
        store = type(live)(tmp_path / f"live{replay}", 1 << 30)
        aligner = LoraAligner(cfg, store, tmp_path / f"root{replay}", model.embed_tokens, output_matrix(model),
                              gamma=3, ttt_steps=3, max_segment_len=64)
        for shard in shards:
            store.append(shard)
            aligner.step(base, 1)
            assert sum(n for _, _, n in aligner.window) <= replay
        windows[replay] = list(steps)
    assert len(windows[40]) >= 2 and any(windows[40][1:])  # later updates replay earlier buffers' segments
    assert not any(windows[0])  # EvoSpec's buffer: each update trains on its own rows only


def test_a_new_base_version_drops_remembered_tokens_it_owns(model: DecoderModel, tok, tmp_path: Path) -> None:
    _, shards, live = served_in_turn(model, tok, tmp_path)
    cfg = LoraAlignConfig(enabled=True, rank=4, alpha=8.0, buffer_rows=8, min_rows=8, topk=6, extra_vocab=512)
    aligner = LoraAligner(cfg, live, tmp_path / "root", model.embed_tokens, output_matrix(model), gamma=3,
                          ttt_steps=3, max_segment_len=64)
    live.append(shards[0])
    aligner.step(pruned_head(model, 1), 1)
    remembered = set(aligner.recent)
    assert remembered and min(remembered) >= OWN
    wider = random_head(model, 2, max(remembered) + 1)  # a full round's head owning every remembered token
    aligner.step(wider, 2)
    assert aligner.base_version == 2
    with aligner._wide(aligner.head) as head:
        assert head.cfg.draft_vocab_size == max(remembered) + 1  # nothing added: all of them are its own


def test_traffic_outside_the_heads_vocabulary_is_left_to_the_full_rounds(model: DecoderModel, tok,
                                                                        tmp_path: Path) -> None:
    """Adapters cannot add vocabulary: on rows whose next tokens mostly lie outside the pruned head's 24
    (a new script to a real head) the aligner neither runs its eligibility pass nor updates; the same rows
    covered by the remembered extra tokens, or with the gate off, make an update."""
    _, shards, _ = served_in_turn(model, tok, tmp_path)
    labels = torch.cat([s.token_ids[1:] for s in shards])
    inside = float((labels < OWN).float().mean())
    assert inside < 0.7  # the precondition: this traffic is mostly outside the head's vocabulary
    base = pruned_head(model, 1)
    common = {"enabled": True, "rank": 4, "alpha": 8.0, "buffer_rows": 8, "steps": 6, "lr": 5e-3, "min_rows": 8,
              "topk": 6, "judge_rows": 16}
    updates = {}
    for name, extra, coverage in (("default", 0, LoraAlignConfig.min_coverage), ("extra", 512, 0.7),
                                  ("off", 0, 0.0)):
        live = SignalStore(tmp_path / f"live-{name}", 1 << 30)
        cfg = LoraAlignConfig(**common, extra_vocab=extra, min_coverage=coverage)
        aligner = LoraAligner(cfg, live, tmp_path / f"root-{name}", model.embed_tokens, output_matrix(model),
                              gamma=3, ttt_steps=3, max_segment_len=64)
        for shard in shards:
            live.append(shard)
            aligner.step(base, 1)
        updates[name] = (aligner.pending is not None or bool(aligner.results), aligner.num_uncovered_rows)
    assert updates["default"][0] is False and updates["default"][1] > 0
    assert updates["extra"][0] and updates["off"] == (True, 0)
    with pytest.raises(TrainerConfigError, match="lora_min_coverage"):
        LoraAlignConfig(min_coverage=1.5)
