"""Distillation recipe: diverse continuations, the teacher pass, soft labels, init from the target, lr schedule."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.helpers import full_logits, run_to_completion, tiny_llama, tiny_tokenizer
from tests.speculative.test_eagle3 import tiny_target
from tidespec.config import CacheConfig, EngineConfig, SpecConfig
from tidespec.engine.engine import LLMEngine
from tidespec.models.eagle3.head import Eagle3Config, Eagle3ConfigError, Eagle3Head, init_from_target
from tidespec.models.kv.cache import KVCache
from tidespec.models.layout import BatchLayout
from tidespec.online.store import SignalStore
from tidespec.online.training.data import deepen_head, segments_by_sequence, split_heldout, token_counts, widen_head
from tidespec.online.training.distill import generate_continuations, teacher_pass, teacher_rows
from tidespec.online.training.eagle3_train import (
    Eagle3TrainError,
    SignalBatch,
    SignalSegment,
    _soft_loss,
    acceptance_stats,
    evaluate,
    select_draft_vocab,
    ttt_loss,
    unroll,
    walk_chains,
)
from tidespec.online.training.rounds import lr_factor
from tidespec.sampling import SamplingParams
from tidespec.speculative.api import DraftInput, DraftProposal
from tidespec.speculative.drafters.eagle3 import Eagle3Drafter, Eagle3DrafterConfig
from tidespec.workloads.loader import Prompt, WorkloadRecord

VOCAB = 64


def _prompts(n: int) -> list[Prompt]:
    gen = torch.Generator().manual_seed(3)
    return [Prompt(WorkloadRecord(f"p{i}", "code" if i % 2 else "chat", "completion", "x"),
                   torch.randint(2, VOCAB, (5,), generator=gen).tolist()) for i in range(n)]


def test_continuations_first_greedy_then_sampled_and_teacher_rows_match_full_logits(tmp_path: Path) -> None:
    target = tiny_llama(VOCAB, layers=4)
    seqs = generate_continuations(target, tiny_tokenizer(VOCAB), _prompts(3), samples=3, temperature=1.5,
                                  max_tokens=12, progress=False)
    assert [(c.prompt_index, c.sample) for c in seqs] == [(i, k) for i in range(3) for k in range(3)]
    for c in seqs[::3]:  # sample 0 is the greedy continuation
        logits = full_logits(target, c.token_ids)
        assert c.token_ids[6:] == logits[5:-1].argmax(-1).tolist()
    assert len({tuple(c.token_ids) for c in seqs}) > 3  # sampling diversifies
    taps_layers = Eagle3Config.for_target(target.cfg).tap_layers
    j, c = max(enumerate(seqs), key=lambda jc: len(jc[1].token_ids))
    assert len(c.token_ids) > 16
    taps, ids, logits = teacher_rows(target, c.token_ids, taps_layers, 4)
    ref = full_logits(target, c.token_ids)[:-1]  # [N-1, V]
    assert taps.shape == (len(c.token_ids) - 1, 3 * target.cfg.hidden_size)
    assert torch.equal(ids, ref.topk(4).indices) and torch.allclose(logits, ref.topk(4).values.float())

    store = SignalStore(tmp_path / "s", 1 << 30)
    rows = teacher_pass(target, seqs, taps_layers, 4, store, shard_rows=40, progress=False)
    shards = [sh for _, sh in store.iter_shards()]
    # a prompt's rows once (sample 0); sampled continuations from the prompt's last position (4)
    want = sum(len(c.token_ids) - (1 if c.sample == 0 else c.prompt_len) for c in seqs)
    assert rows == want == sum(sh.num_signals for sh in shards)
    assert len(shards) > 1 and all(sh.topk_ids is not None and sh.topk_ids.shape[1] == 4 for sh in shards)
    by_seq = segments_by_sequence(shards, 8)
    assert sorted(by_seq) == list(range(len(seqs)))
    key = c.sample * 3 + c.prompt_index  # sample-major store seq ids
    first = by_seq[key][0].start_position
    assert first == (0 if c.sample == 0 else 4)
    seg = by_seq[key][1]  # second piece: positions first+8 .. first+15
    assert seg.start_position == first + 8 and seg.topk_ids is not None
    assert torch.equal(seg.topk_ids, ids[first + 8:first + 16])
    assert torch.equal(seg.token_ids, torch.tensor(c.token_ids[first + 8:first + 17]))


def test_greedy_mask_of_labels_and_soft_label_indexing() -> None:
    taps = torch.zeros(4, 6)
    tokens = torch.tensor([5, 6, 7, 8, 9])  # position i holds tokens[i]; 9 followed position 3
    top = torch.tensor([[6, 1], [2, 7], [8, 1], [9, 1]])  # the target's greedy after position 1 was 2, not 7
    seg = SignalSegment(taps, tokens, None, 0, top, torch.zeros(4, 2))
    labels, valid = seg.labels(1)  # row j, step 1 predicts position j + 2
    assert labels.tolist() == [7, 8, 9, 9] and valid.tolist() == [False, True, True, False]
    ids, _, ok = seg.soft_labels(1)  # the target's top-k at position j + 1
    assert ids[:, 0].tolist() == [2, 8, 9, 9] and ok.tolist() == [True, True, True, False]
    halves = [seg.slice(0, 2), seg.slice(2, 4)]
    assert halves[1].start_position == 2 and torch.equal(halves[1].topk_ids, top[2:])
    with pytest.raises(ValueError, match="together"):
        SignalSegment(taps, tokens, None, 0, top, None)


def test_soft_loss_worked_example_and_out_of_vocab_entries() -> None:
    # draft vocab = target ids {3, 4, 5} (draft ids 0..2); target top-k (4, 3) with logits (2, 1)
    t2d = torch.full((8,), -1, dtype=torch.int64)
    t2d[3:6] = torch.arange(3)
    logits = torch.log(torch.tensor([[[0.25, 0.6, 0.15]]]))  # draft log-probs
    row, top1, keep = _soft_loss(logits, torch.tensor([[[4, 3]]]), torch.tensor([[[2.0, 1.0]]]),
                                 torch.tensor([[True]]), t2d)
    p = torch.softmax(torch.tensor([2.0, 1.0]), 0)
    assert math.isclose(float(row), -(p[0] * math.log(0.6) + p[1] * math.log(0.25)), rel_tol=1e-6)
    assert int(top1) == 1 and bool(keep)
    # an out-of-vocab entry is dropped and the rest renormalised; an out-of-vocab top-1 drops the row
    row, _, keep = _soft_loss(logits, torch.tensor([[[4, 7]]]), torch.tensor([[[2.0, 1.0]]]),
                              torch.tensor([[True]]), t2d)
    assert math.isclose(float(row), -math.log(0.6), rel_tol=1e-6) and bool(keep)
    _, _, keep = _soft_loss(logits, torch.tensor([[[7, 4]]]), torch.tensor([[[2.0, 1.0]]]), torch.tensor([[True]]), t2d)
    assert not bool(keep)


def _distill_segments(target: torch.nn.Module, n: int, length: int, seed: int) -> list[SignalSegment]:
    """Greedy continuations of random prompts with their teacher-pass top-k (K=4)."""
    taps_layers = Eagle3Config.for_target(target.cfg).tap_layers
    gen = torch.Generator().manual_seed(seed)
    segs = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (4,), generator=gen).tolist()
        while len(ids) < length + 1:
            ids.append(int(full_logits(target, ids)[-1].argmax()))
        taps, top_ids, top_logits = teacher_rows(target, ids, taps_layers, 4)
        segs.append(SignalSegment(taps, torch.tensor(ids), None, 0, top_ids, top_logits))
    return segs


@pytest.mark.parametrize("distill", ["soft", "top1"])
def test_distillation_raises_simulated_acceptance(distill: str) -> None:
    target = tiny_target(torch.float32, seed=0, vocab=VOCAB)
    segs = _distill_segments(target, 12, 32, seed=0)
    train, held_out = segs[:8], segs[8:]
    torch.manual_seed(1)
    head = Eagle3Head(Eagle3Config.for_target(target.cfg))
    before = evaluate(head, target.embed_tokens, held_out, gamma=3)
    losses = [float(ttt_loss(head, target.embed_tokens, train, 3, distill=distill)[0].detach())]
    optimizer = torch.optim.AdamW(head.parameters(), lr=3e-3, betas=(0.9, 0.95))
    for _ in range(110):
        loss, _ = ttt_loss(head, target.embed_tokens, train, 3, distill=distill)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.5 * losses[0]
    assert evaluate(head, target.embed_tokens, held_out, gamma=3) > before + 0.5


def test_init_from_target_copies_lm_head_rows_and_last_layer() -> None:
    target = tiny_llama(VOCAB, layers=4)
    head = Eagle3Head(Eagle3Config.for_target(target.cfg, 8)).to(torch.float64)
    counts = torch.zeros(VOCAB, dtype=torch.int64)
    counts[torch.arange(5, 61, 7)] = 1  # draft vocab: target ids 5, 12, ..., 54
    head.set_vocab_map(*select_draft_vocab(counts, 8))
    init_from_target(head, target, "lm_head")
    assert torch.equal(head.lm_head.weight, target.lm_head.weight[5:61:7])
    assert torch.equal(head.norm.weight, target.norm.weight)
    init_from_target(head, target, "layer")
    # one position: the head's first step is the target's last layer on the highest tap
    ids = [3, 9, 4]
    taps_layers = head.cfg.tap_layers
    taps = teacher_rows(target, ids + [1], taps_layers, 1)[0][:1]  # [1, 3H]
    seg = SignalSegment(taps, torch.tensor(ids[:2]))
    prenorm_logits = unroll(head, target.embed_tokens, SignalBatch.collate([seg], head), 1)[0]  # [1, 1, Vd]
    h = taps[:, 2 * target.cfg.hidden_size:]  # [1, H] the hidden entering layer taps_layers[-1]
    kv = KVCache(1, 1, 4, target.cfg.num_kv_heads, target.cfg.head_dim, torch.float64)
    layout = BatchLayout.build([1], [0], [0])
    layout.attention_plan(None, kv)
    rope = target.rope(layout.positions, torch.float64)
    out = target.layers[-1].forward(h, rope, layout, kv.k[0], kv.v[0])  # [1, H]
    assert torch.allclose(prenorm_logits[0], head.logits(out), atol=1e-10)
    with pytest.raises(Eagle3ConfigError, match="init-from-target"):
        init_from_target(head, target, "everything")


def test_deepen_head_starts_as_the_shallow_head_with_the_targets_last_layers() -> None:
    target = tiny_llama(VOCAB, layers=4)
    torch.manual_seed(3)
    head = Eagle3Head(Eagle3Config.for_target(target.cfg, 16)).to(torch.float64)
    deep = deepen_head(head, 3, list(target.layers))
    assert deep.cfg.num_layers == 3 and len(deep.blocks) == 2 and deep.training == head.training
    for block, source in zip(deep.blocks, list(target.layers)[-2:]):
        assert not block.self_attn.o_proj.weight.any() and not block.mlp.down_proj.weight.any()
        assert torch.equal(block.self_attn.qkv_proj.weight, source.self_attn.qkv_proj.weight)
        assert torch.equal(block.mlp.gate_up_proj.weight, source.mlp.gate_up_proj.weight)
    assert torch.equal(deep.midlayer.self_attn.qkv_proj.weight, head.midlayer.self_attn.qkv_proj.weight)
    # the same outputs over a 5-token context: the new blocks add nothing to their residual yet
    gen = torch.Generator().manual_seed(0)
    fused = torch.randn(5, head.cfg.hidden_size, generator=gen, dtype=torch.float64)
    embeds = torch.randn(5, head.cfg.hidden_size, generator=gen, dtype=torch.float64)
    outs = []
    for h in (head, deep):
        c = h.cfg
        kv = KVCache(c.num_layers, 1, 16, c.num_kv_heads, c.head_dim, torch.float64)
        outs.append(h(fused, embeds, BatchLayout.build([5], [0], [0]), kv))
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(outs[1][1], outs[0][1], rtol=1e-12, atol=1e-12)
    for n in (1, 5):
        with pytest.raises(Eagle3TrainError, match="cannot be deepened"):
            deepen_head(head, n, list(target.layers))


def test_widen_head_keeps_its_tokens_and_rows_and_adds_the_most_frequent_others() -> None:
    target = tiny_llama(VOCAB, layers=4)
    head = Eagle3Head(Eagle3Config.for_target(target.cfg, 8)).to(torch.float64)
    counts = torch.zeros(VOCAB, dtype=torch.int64)
    counts[torch.arange(5, 61, 7)] = 1
    head.set_vocab_map(*select_draft_vocab(counts, 8))  # own tokens 5, 12, ..., 54
    # training text: 3 x token 2, 2 x token 41, 1 x token 30, and own tokens, more frequent but already in
    text = torch.tensor([2, 2, 2, 41, 41, 30, 5, 5, 5, 5, 12])
    seg = SignalSegment(torch.zeros(text.shape[0] - 1, head.cfg.tap_size, dtype=torch.float64), text)
    assert token_counts([seg], VOCAB)[[2, 41, 30, 5]].tolist() == [3, 2, 1, 4]
    wide = widen_head(head, 10, [seg], target.lm_head.weight)
    own = torch.arange(5, 61, 7)
    ids = wide.draft_to_target(torch.arange(10))
    assert ids.tolist() == sorted(own.tolist() + [2, 41])  # the two most frequent tokens not yet drafted
    assert wide.cfg.draft_vocab_size == 10 and int(wide.t2d.sum()) == 10
    # old rows unchanged at their new draft ids, new ones the head's calibrated rows for them
    inv = wide.target_to_draft()
    assert torch.equal(wide.lm_head.weight[inv[own]], head.lm_head.weight)
    new = torch.tensor([2, 41])
    assert torch.allclose(wide.lm_head.weight[inv[new]], head.output_rows(new, target.lm_head.weight.float()))
    # the layers are the head's: the same pre-norm output, the same logits on the old vocabulary
    taps = torch.randn(3, head.cfg.tap_size, dtype=torch.float64)
    assert torch.equal(wide.fuse(taps), head.fuse(taps))
    h = torch.randn(3, head.cfg.hidden_size, dtype=torch.float64)
    assert torch.allclose(wide.logits(h)[:, inv[own]], head.logits(h))
    assert wide.dtype == head.dtype and wide.training == head.training
    for n in (7, VOCAB + 1):
        with pytest.raises(Eagle3TrainError, match="cannot be widened"):
            widen_head(head, n, [seg], target.lm_head.weight)


def test_ttt_loss_distils_when_segments_carry_topk() -> None:
    target = tiny_llama(VOCAB, layers=4)
    seg = _distill_segments(target, 1, 12, seed=2)[0]
    torch.manual_seed(0)
    head = Eagle3Head(Eagle3Config.for_target(target.cfg)).to(torch.float64)
    soft, _ = ttt_loss(head, target.embed_tokens, [seg], 2)
    hard, _ = ttt_loss(head, target.embed_tokens, [SignalSegment(seg.taps, seg.token_ids)], 2)
    assert soft.requires_grad and float(soft.detach()) != float(hard.detach())  # the soft targets are not one-hot
    assert split_heldout({0: [seg]}, 0.25)[1][0].topk_ids is not None


def test_lr_factor_warmup_and_cosine() -> None:
    f = [lr_factor(i, 10, 2, "cosine") for i in range(10)]
    assert f[:3] == [0.5, 1.0, 1.0] and math.isclose(f[-1], 0.1) and all(a >= b for a, b in zip(f[1:], f[2:]))
    assert [lr_factor(i, 5, 0, "constant") for i in range(5)] == [1.0] * 5


def test_bf16_autocast_training_learns_and_keeps_float32_weights(tmp_path: Path) -> None:
    from tidespec.online.training.config import TrainerConfig
    from tidespec.online.training.rounds import DraftTrainer

    target = tiny_target(torch.float32, seed=0, vocab=VOCAB)
    segs = _distill_segments(target, 8, 32, seed=0)
    cfg = TrainerConfig(signal_dir=str(tmp_path / "s"), publish_root=str(tmp_path / "p"), max_steps=60, lr=3e-3,
                        autocast="bf16", progress=False)
    trainer = DraftTrainer(cfg, target.cfg, target.embed_tokens)
    torch.manual_seed(1)
    head = Eagle3Head(Eagle3Config.for_target(target.cfg))
    losses: list[float] = []
    trainer.train_head(head, segs, seed=0, on_step=lambda step, loss: losses.append(loss))
    assert losses[-1] < 0.7 * losses[0]
    assert all(p.dtype == torch.float32 for p in head.parameters())


def trained_head(target: torch.nn.Module, head: Eagle3Head, train: list[SignalSegment], steps: int = 80) -> Eagle3Head:
    """``head`` after ``steps`` AdamW training-time-test steps (3 unrolled) on all of ``train``, in eval mode."""
    optimizer = torch.optim.AdamW(head.parameters(), lr=3e-3, betas=(0.9, 0.95))
    for _ in range(steps):
        loss, _ = ttt_loss(head, target.embed_tokens, train, 3)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return head.eval()


def test_walked_acceptance_is_what_the_engine_serves() -> None:
    """``acceptance_stats``' walk steps where a greedy server drafts and emits what it emits: a
    trained head serving one request through the engine (float64, gamma 3) and the walk over the
    teacher-forced rows of the same output give the same steps and tokens; the per-row mean
    differs (easy stretches count at each row there)."""
    target = tiny_target(torch.float64, seed=0, vocab=VOCAB)
    torch.manual_seed(1)
    head = trained_head(target, Eagle3Head(Eagle3Config.for_target(target.cfg)).to(torch.float64),
                        _distill_segments(target, 8, 32, seed=0))
    drafter = Eagle3Drafter(head, target.embed_tokens, Eagle3DrafterConfig(max_num_seqs=1, max_model_len=64))
    config = EngineConfig(cache=CacheConfig(max_num_seqs=1, max_model_len=64),
                          spec=SpecConfig(drafter="eagle3", num_speculative_tokens=3))
    engine = LLMEngine(target, tiny_tokenizer(VOCAB), config, drafter=drafter)
    prompt = torch.randint(0, VOCAB, (5,), generator=torch.Generator().manual_seed(7)).tolist()
    engine.add_request(prompt, SamplingParams(max_tokens=40, ignore_eos=True))
    steps: list[tuple[int, list[int]]] = []  # (context length, drafts) of every speculating step
    propose = drafter.propose

    def spy(inputs: list[DraftInput]) -> DraftProposal:
        out = propose(inputs)
        steps.extend((len(i.token_ids), list(out.drafts[i.seq_id].token_ids)) for i in inputs if i.seq_id in out.drafts)
        return out

    drafter.propose = spy  # type: ignore[method-assign]
    full = prompt + next(iter(run_to_completion(engine).values())).token_ids
    served_tokens = 0
    for n, drafts in steps:  # what each step emitted, cut where the output ends (as the walk's labels are)
        k = 0
        while k < len(drafts) and n + k < len(full) and drafts[k] == full[n + k]:
            k += 1
        served_tokens += min(k + 1, len(full) - n)  # the last step's tokens end at max_tokens
    assert served_tokens == len(full) - len(prompt) - 1  # every generated token but the prefill's
    assert len(steps) >= 8 and served_tokens > len(steps)  # the head accepts something
    taps, top_ids, top_logits = teacher_rows(target, full, Eagle3Config.for_target(target.cfg).tap_layers, 4)
    top_ids = top_ids.clone()
    top_ids[:len(prompt), 0] = -1  # rows before the last prompt row: the server drafts nowhere there
    seg = SignalSegment(taps, torch.tensor(full), None, 0, top_ids, top_logits)
    stats = acceptance_stats(head, target.embed_tokens, [seg], 3)
    assert (stats.walk_steps, stats.walk_tokens) == (len(steps), served_tokens)
    assert stats.row_mean != stats.walk_mean and stats.walk_mean == served_tokens / len(steps)
    assert walk_chains([2, 0, 0, 1, 0, 0], [True] * 5 + [False]) == (2, 5)
    assert walk_chains([2, 0, 0, 1, 0, 0], [True, True, True, False, True, False]) == (2, 4)
