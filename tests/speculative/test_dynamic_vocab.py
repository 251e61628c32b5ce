"""EvoSpec's dynamic draft vocabulary: ARC, the co-occurrence graph, HNSW retrieval, the worker,
and lossless drafting over a V_t that changes between steps."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.helpers import run_to_completion, tiny_llama, tiny_tokenizer
from tidespec.config import CacheConfig, DraftVocabConfig, EngineConfig, SpecConfig
from tidespec.engine.engine import LLMEngine
from tidespec.engine.observer import Hooks
from tidespec.errors import ConfigError
from tidespec.llm import attach_draft_vocab
from tidespec.models.eagle3.head import Eagle3Config, Eagle3Head, fit_row_map, init_from_target
from tidespec.models.families.decoder import DecoderModel
from tidespec.models.quant.quantize import Int8Linear
from tidespec.sampling import SamplingParams
from tidespec.speculative.drafters.draft_model import DraftModelDrafter, DraftModelOptions
from tidespec.speculative.drafters.eagle3 import Eagle3Drafter, Eagle3DrafterConfig
from tidespec.speculative.vocab.arc import ArcBuffer, ArcConfig
from tidespec.speculative.vocab.dynamic import DynamicVocab, DynamicVocabConfig
from tidespec.speculative.vocab.graph import CooccurrenceGraph, GraphConfig
from tidespec.speculative.vocab.index import MipsIndex

V = 48
PROMPTS = [[5, 6, 7, 8, 5, 6, 7], [9, 10, 11], [12, 13, 14, 15, 16, 12, 13, 14, 15, 16, 12], [3, 3, 3, 3]]


# -- ARC ------------------------------------------------------------------------------------------


def test_arc_worked_example() -> None:
    arc = ArcBuffer(ArcConfig(capacity=2, min_residency=0, warmup_events=0, initial_p=1))
    assert arc.admit([10, 11], step=0) == [10, 11]
    arc.touch([10], step=1)
    assert list(arc.t1) == [11] and list(arc.t2) == [10]
    arc.admit([12], step=2)
    assert list(arc.b2) == [10]
    arc.admit([10], step=3)
    assert arc.p == 0 and arc.resident() == [12, 10] and list(arc.b1) == [11]
    assert arc.stats.ghost_hits == 1 and arc.stats.evicted == 2


def test_arc_bounds_insertions_and_keeps_young_tokens() -> None:
    arc = ArcBuffer(ArcConfig(capacity=4, max_insert=3, min_residency=5, warmup_events=0))
    assert arc.admit(list(range(10)), step=0) == [0, 1, 2]  # at most max_insert per event
    assert arc.admit([3, 4, 5], step=1) == [3]  # full after one; the others are too young to evict
    assert arc.stats.blocked == 1 and len(arc) == 4
    assert arc.admit([7], step=5) == [7]  # 0 is old enough now: T1's LRU goes
    assert 0 not in arc and len(arc) == 4


def test_arc_config_validation() -> None:
    with pytest.raises(ConfigError, match="arc_capacity"):
        ArcConfig(capacity=0)
    with pytest.raises(ConfigError, match="initial_p"):
        ArcConfig(capacity=4, initial_p=5)


# -- graph and index --------------------------------------------------------------------------------


def test_graph_worked_example_and_pruning() -> None:
    g = CooccurrenceGraph(GraphConfig(min_count=2, tau=0.3, max_degree=4))
    g.add([1, 2, 3, 1, 2, 4, 1, 2, 3])
    assert g.successors(1, k=8) == [2]
    assert g.successors(2, k=8) == [3]
    assert g.successors(99, k=8) == []
    assert g.most_frequent(2) == [1, 2]
    g.add([3], previous=2)  # a stream that continues another
    assert g.edges[2][3] == 3


def test_mips_index_finds_the_largest_inner_products() -> None:
    assert MipsIndex.build(torch.eye(4)).query(torch.tensor([0.0, 3.0, 1.0, 0.0]), 2) == [1, 2]
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(500, 16, generator=gen) * torch.rand(500, 1, generator=gen) * 3  # norms differ
    idx = MipsIndex.build(rows)
    hits = 0
    for _ in range(20):
        q = torch.randn(16, generator=gen)
        exact = set((rows @ q).topk(10).indices.tolist())
        hits += len(exact & set(idx.query(q, 10)))
    assert hits / 200 >= 0.9  # norm augmentation makes L2 search a MIPS


def test_index_is_cached_on_disk(tmp_path: Path) -> None:
    rows = torch.randn(64, 8)
    first = MipsIndex.cached(rows, cache_dir=tmp_path)
    assert len(list(tmp_path.glob("*.bin"))) == 1
    again = MipsIndex.cached(rows, cache_dir=tmp_path)
    q = torch.randn(8)
    assert again.query(q, 5) == first.query(q, 5)


# -- the dynamic vocabulary -------------------------------------------------------------------------


def _rows(ids: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.one_hot(ids, V).double()  # [n, V]: row of token t = e_t


def _graph_7_to_8() -> CooccurrenceGraph:
    g = CooccurrenceGraph(GraphConfig(min_count=1, tau=0.0))
    g.add([7, 8] * 3)
    return g


def test_oov_event_admits_the_token_and_its_successors_off_the_caller() -> None:
    cfg = DynamicVocabConfig(core_size=2, semantic_k=0, buffer=ArcConfig(capacity=4, min_residency=0))
    vocab = DynamicVocab(cfg, [0, 1], _rows, graph=_graph_7_to_8(), start=False)
    assert vocab.snapshot.ids.tolist() == [0, 1] and vocab.snapshot.version == 0
    vocab.record([(0, None), (7, None)], [(None, [0, 7])])
    assert vocab.snapshot.version == 0  # nothing changes until the worker ran
    assert (vocab.stats.verified, vocab.stats.covered, vocab.stats.oov_events) == (2, 1, 1)
    vocab.drain()
    snap = vocab.snapshot
    assert snap.ids.tolist() == [0, 1, 7, 8] and snap.version == 1
    assert torch.equal(snap.rows, _rows(snap.ids)) and 8 in snap.members


def test_steps_without_oov_reach_the_worker_in_batches() -> None:
    """Hits and graph streams of ``batch_steps`` steps make one record; an OOV event sends at once
    (with what was held); nothing is lost: the graph learns every stream."""
    cfg = DynamicVocabConfig(core_size=2, semantic_k=0, batch_steps=3, buffer=ArcConfig(capacity=4, min_residency=0))
    vocab = DynamicVocab(cfg, [0, 1], _rows, start=False)
    for _ in range(2):
        vocab.record([(0, None)], [(None, [0, 1])])
    assert vocab._pending.qsize() == 0  # held: no worker wake-up yet
    vocab.record([(1, None)], [(1, [0])])
    assert vocab._pending.qsize() == 1  # the third step sends the batch
    vocab.record([(0, None)], [(0, [1])])
    vocab.record([(9, None)], [(1, [9])])
    assert vocab._pending.qsize() == 2  # an OOV event goes at once, with the held step
    vocab.process_pending()
    assert vocab.graph.edges[0][1] == 3 and vocab.graph.edges[1][0] == 1 and vocab.graph.edges[1][9] == 1
    assert 9 in vocab.snapshot.members


def test_static_mode_counts_coverage_and_never_changes() -> None:
    vocab = DynamicVocab(DynamicVocabConfig(core_size=2, dynamic=False), [0, 1], _rows, start=False)
    vocab.record([(5, None)], [(None, [5])])
    vocab.drain()
    assert vocab.snapshot.version == 0 and vocab.stats.oov_events == 1 and vocab.stats.coverage == 0.0


def test_a_failing_update_keeps_the_last_snapshot() -> None:
    calls = {"n": 0}

    def flaky(ids: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] > 1:
            raise RuntimeError("rows unavailable")
        return _rows(ids)

    vocab = DynamicVocab(DynamicVocabConfig(core_size=2, semantic_k=0), [0, 1], flaky, graph=_graph_7_to_8())
    try:
        vocab.record([(7, None)], [])
        vocab.drain()
        assert vocab.stats.errors == 1 and vocab.snapshot.version == 0
    finally:
        vocab.close()


def test_a_publish_builds_the_buffer_only_until_the_rows_change() -> None:
    """The core's rows and int8 layer are kept between publishes (a full rebuild took a core from
    the step at every publish); joined with the buffer's they equal a layer built over all of V_t's
    rows, exactly; after ``refresh`` (new head weights) the core is built again from the new rows."""
    base = torch.randn(V, 16)
    asked: list[list[int]] = []

    def rows_by(scale: float) -> Callable[[torch.Tensor], torch.Tensor]:
        def rows_for(ids: torch.Tensor) -> torch.Tensor:
            asked.append(ids.tolist())
            return scale * base[ids]
        return rows_for

    cfg = DynamicVocabConfig(core_size=4, semantic_k=0, buffer=ArcConfig(capacity=4, min_residency=0))
    vocab = DynamicVocab(cfg, [0, 1, 2, 3], rows_by(1.0), graph=_graph_7_to_8(), start=False,
                         output_for=Int8Linear.from_weight, output_join=Int8Linear.concat)
    vocab.record([(7, None)], [])
    vocab.drain()
    assert asked == [[0, 1, 2, 3], [7, 8]]  # the publish computed the two buffer rows only
    snap = vocab.snapshot
    whole = Int8Linear.from_weight(base[snap.ids])
    assert isinstance(snap.output, Int8Linear) and snap.ids.tolist() == [0, 1, 2, 3, 7, 8]
    assert torch.equal(snap.output.qweight, whole.qweight) and torch.equal(snap.output.scales, whole.scales)
    assert torch.equal(snap.rows, base[snap.ids])
    vocab.record([(9, None)], [])
    vocab.drain()
    snap = vocab.snapshot
    assert asked[-1] == [9] and sorted(snap.ids.tolist()) == [0, 1, 2, 3, 7, 8, 9]  # 7 and 8 kept their rows
    whole = Int8Linear.from_weight(base[snap.ids])
    assert isinstance(snap.output, Int8Linear) and torch.equal(snap.output.qweight, whole.qweight)
    vocab.refresh(rows_by(2.0))
    vocab.drain()
    assert asked[-2][:4] == [0, 1, 2, 3] and sorted(asked[-1]) == [7, 8, 9]
    assert torch.equal(vocab.snapshot.rows, 2.0 * base[vocab.snapshot.ids])
    assert vocab.stats.published == 3 and vocab.stats.mean_build_ms >= 0.0


def test_records_queued_while_the_worker_was_busy_make_one_publish() -> None:
    cfg = DynamicVocabConfig(core_size=2, semantic_k=0, buffer=ArcConfig(capacity=8, min_residency=0))
    vocab = DynamicVocab(cfg, [0, 1], _rows, start=False)
    for tok in (5, 6, 7):
        vocab.record([(tok, None)], [])
    assert vocab._pending.qsize() == 3
    vocab.process_pending()
    assert vocab.stats.published == 1 and {5, 6, 7} <= vocab.snapshot.members


class _BlockingIndex(MipsIndex):
    """An index whose queries wait until released: retrieval that takes forever."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.queried = threading.Event()

    def query(self, hidden: torch.Tensor, k: int) -> list[int]:
        self.queried.set()
        self.release.wait(timeout=30)
        return [9]


def test_the_step_never_waits_on_retrieval(target: DecoderModel) -> None:
    """While the worker is stuck in a query, the engine keeps stepping (and finishes requests)
    with the V_t it had; once the query returns, V_t grows."""
    index = _BlockingIndex()
    head = init_from_target(_head(target), target, "layer")
    drafter = _drafter(head, target, 4)
    vocab = DynamicVocab(DynamicVocabConfig(core_size=6, buffer=ArcConfig(capacity=8, min_residency=0)),
                         list(range(6)), lambda ids: head.output_rows(ids, target.lm_head.weight), index=index)
    drafter.vocab = vocab
    try:
        engine = LLMEngine(target, tiny_tokenizer(V), EngineConfig(
            cache=CacheConfig(max_model_len=96, max_num_seqs=4), spec=SpecConfig(drafter="eagle3")), drafter=drafter)
        ids = [engine.add_request(p, SamplingParams(max_tokens=16, ignore_eos=True)) for p in PROMPTS]
        done = run_to_completion(engine)
        assert index.queried.is_set() and all(len(done[i].token_ids) == 16 for i in ids)
        assert vocab.snapshot.version == 0  # everything ran on the V_t of before the query
        index.release.set()
        vocab.drain()
        assert vocab.snapshot.version >= 1 and 9 in vocab.snapshot.members
    finally:
        index.release.set()
        vocab.close()


# -- lossless drafting over a changing V_t -----------------------------------------------------------


@pytest.fixture(scope="module")
def target() -> DecoderModel:
    return tiny_llama(V, layers=4, seed=2, scale=3.0)


def _head(target: DecoderModel, seed: int = 1, draft_vocab: int | None = None) -> Eagle3Head:
    torch.manual_seed(seed)
    head = Eagle3Head(Eagle3Config.for_target(target.cfg, draft_vocab)).to(target.dtype)
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3)
    return head


def _drafter(head: Eagle3Head, target: DecoderModel, slots: int, quantization: str = "none") -> Eagle3Drafter:
    return Eagle3Drafter(head, target.embed_tokens, Eagle3DrafterConfig(max_num_seqs=slots, max_model_len=128,
                                                                        tree_depth=3, tree_top_k=2,
                                                                        quantization=quantization))


def _generate(target: DecoderModel, drafter: Eagle3Drafter | DraftModelDrafter | None, spec: SpecConfig, slots: int,
              between_steps: list[Callable[[LLMEngine], None]] | None = None) -> list[list[int]]:
    out: list[list[int]] = []
    for start in range(0, len(PROMPTS), slots):
        engine = LLMEngine(target, tiny_tokenizer(V), EngineConfig(
            cache=CacheConfig(max_model_len=96, max_num_seqs=slots), spec=spec), drafter=drafter)
        for hook in between_steps or []:
            engine.add_observer(Hooks(step_start=hook))
        params = SamplingParams(max_tokens=24, ignore_eos=True)
        ids = [engine.add_request(p, params) for p in PROMPTS[start:start + slots]]
        done = run_to_completion(engine)
        out += [done[i].token_ids for i in ids]
    return out


@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("quantization", ["none", "int8"])
def test_greedy_equals_plain_while_v_t_changes(target: DecoderModel, tree: bool, batch: int, quantization: str) -> None:
    """A head with a 24-token draft vocabulary drafting over a 6-token core + 6-token buffer that
    the worker refills between steps (synchronously here, so every run is the same); swapped
    head weights mid-run republish V_t's rows. int8: the head drafts in int8, V_t through an
    int8 layer of its rows."""
    plain = _generate(target, None, SpecConfig(), 4)
    head = init_from_target(_head(target, draft_vocab=24), target, "layer")
    drafter = _drafter(head, target, batch, quantization)
    lm = target.lm_head.weight.detach()
    cfg = DynamicVocabConfig(core_size=6, semantic_k=4, graph=GraphConfig(min_count=1, tau=0.0),
                             buffer=ArcConfig(capacity=6, max_insert=3, min_residency=1, warmup_events=0))
    vocab = DynamicVocab(cfg, list(range(6)), lambda ids: drafter.head.output_rows(ids, lm),
                         index=MipsIndex.build(lm), start=False,
                         output_for=Int8Linear.from_weight if quantization == "int8" else None)
    assert isinstance(vocab.snapshot.weights, Int8Linear if quantization == "int8" else torch.Tensor)
    drafter.vocab = vocab
    swapped = {"done": False}

    def between(_engine: LLMEngine) -> None:
        vocab.process_pending()
        if not swapped["done"] and vocab.snapshot.version >= 3:  # a weight swap while V_t moves
            drafter.load_state(1, _head(target, seed=5, draft_vocab=24).state_dict())
            swapped["done"] = True

    got = _generate(target, drafter, SpecConfig(drafter="eagle3", num_speculative_tokens=4, tree=tree), batch,
                    [between])
    assert got == plain
    assert vocab.stats.oov_events > 0 and vocab.stats.published >= 3 and swapped["done"]


@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("batch", [1, 4])
def test_draft_model_greedy_equals_plain_while_v_t_changes(target: DecoderModel, tree: bool, batch: int) -> None:
    """The independent-draft case (EvoSpec Table 8): a 2-layer truncation of the target drafting
    over a 6-token core + 6-token buffer that the worker refills between steps."""
    plain = _generate(target, None, SpecConfig(), 4)
    lm = target.lm_head.weight.detach()
    cfg = DynamicVocabConfig(core_size=6, semantic_k=4, graph=GraphConfig(min_count=1, tau=0.0),
                             buffer=ArcConfig(capacity=6, max_insert=3, min_residency=1, warmup_events=0))
    vocab = DynamicVocab(cfg, list(range(6)), lambda ids: lm[ids], index=MipsIndex.build(lm), start=False)
    drafter = DraftModelDrafter(target.truncated(2), max_num_seqs=batch, max_model_len=128, vocab=vocab)

    def between(_engine: LLMEngine) -> None:
        vocab.process_pending()

    spec = SpecConfig(drafter="draft-model", num_speculative_tokens=4, tree=tree)
    assert _generate(target, drafter, spec, batch, [between]) == plain
    assert vocab.stats.oov_events > 0 and vocab.stats.published > 0


def test_an_int8_v_t_scores_the_heads_own_tokens_as_its_int8_lm_head_does(target: DecoderModel) -> None:
    """V_t's int8 layer is built from the float head's rows by the same per-row scheme as the
    drafting copy's LM head, so over the head's own tokens both give the same logits."""
    head = _head(target, draft_vocab=24)
    drafter = _drafter(head, target, 1, "int8")
    own = torch.tensor([3, 0, 17, 9])  # target ids inside the head's 24-token vocabulary (identity d2t)
    layer = Int8Linear.from_weight(head.output_rows(own, target.lm_head.weight.detach()))
    prenorm = torch.randn(2, target.cfg.hidden_size, dtype=target.dtype)
    full = drafter.served.logits(prenorm)  # [2, 24] through the int8 LM head
    torch.testing.assert_close(drafter.served.logits(prenorm, layer), full[:, own], rtol=0, atol=0)


def test_v_t_rows_are_the_heads_own_or_the_targets_mapped(target: DecoderModel) -> None:
    head = _head(target, draft_vocab=24)
    lm = target.lm_head.weight.detach()
    ids = torch.tensor([3, 30, 0])  # 30 is outside the head's 24-token vocabulary
    rows = head.output_rows(ids, lm)
    assert torch.equal(rows[0], head.lm_head.weight[3]) and torch.equal(rows[1], lm[30] @ head.row_map(lm))
    h = torch.randn(2, target.cfg.hidden_size, dtype=target.dtype)
    full = head.logits(h)  # [2, 24] over the head's own vocabulary
    torch.testing.assert_close(head.logits(h, rows)[:, [0, 2]], full[:, [3, 0]])


def test_rows_outside_the_heads_vocabulary_follow_how_its_rows_moved(target: DecoderModel) -> None:
    """A head whose trained rows are the target's rotated and halved gets the same for the rest;
    new weights (a version swap) refit the map."""
    head = _head(target, draft_vocab=40)
    lm = target.lm_head.weight.detach()  # [48, H]
    q = torch.linalg.qr(torch.randn(lm.shape[1], lm.shape[1], dtype=lm.dtype, generator=torch.Generator().manual_seed(3)))[0]
    with torch.no_grad():
        head.lm_head.weight.copy_(0.5 * lm[:40] @ q)  # the identity d2t: draft id i is target id i

    def error(got: torch.Tensor, want: torch.Tensor) -> float:  # relative, per row: the ridge shrinks a little
        # (40 random rows in 32 dims: raw target rows would be off by ~2)
        return float(((got - want).norm(dim=1) / want.norm(dim=1)).max())

    assert error(head.output_rows(torch.tensor([41, 47]), lm), 0.5 * lm[[41, 47]] @ q) < 0.2
    with torch.no_grad():
        head.lm_head.weight.copy_(2.0 * lm[:40])
    assert error(head.output_rows(torch.tensor([41]), lm), 2.0 * lm[[41]]) < 0.2


def test_fit_row_map_worked_example() -> None:
    x = torch.randn(64, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    m = fit_row_map(x, 0.5 * x, ridge=0.0)
    torch.testing.assert_close(m, 0.5 * torch.eye(4, dtype=torch.float64))
    assert float(fit_row_map(x, 0.5 * x).diagonal().max()) < 0.5  # the ridge shrinks it a little


def test_the_core_puts_the_drafters_own_tokens_first() -> None:
    g = CooccurrenceGraph(GraphConfig(min_count=1))
    g.add([7, 7, 7, 7, 7, 2, 2, 2, 2, 2, 2, 2, 2, 2, 4])  # counts {7: 5, 2: 9, 4: 1}
    cfg = DynamicVocabConfig(core_size=4, dynamic=False)
    rows = lambda ids: torch.zeros(len(ids), 2)  # noqa: E731
    assert DynamicVocab.from_graph(cfg, g, 12, rows, own=[4, 7, 9], start=False).core == [7, 4, 9, 2]
    assert DynamicVocab.from_graph(cfg, g, 12, rows, start=False).core == [2, 7, 4, 0]  # every row trained


def test_auto_core_keeps_v_t_within_the_drafters_own_rows() -> None:
    assert DraftVocabConfig(mode="dynamic", buffer=512).core_size(8192) == 7680
    assert DraftVocabConfig(mode="static").core_size(8192) == 8192
    assert DraftVocabConfig(mode="dynamic", buffer=512).core_size(49152) == 7680  # at most AUTO_VOCAB_ROWS
    assert DraftVocabConfig(mode="dynamic", buffer=512).core_size(100) == 50  # half stays in the core
    assert DraftVocabConfig(mode="dynamic", core=300).core_size(8192) == 300


# -- sampling: the target's distribution with a dynamic V_t ----------------------------------------


def _sampling_vocab_drafter(monkeypatch: pytest.MonkeyPatch, model: DecoderModel) -> list[DynamicVocab]:
    """Make ``test_spec_sampling``'s engine draft with EAGLE-3 over a 3-token core + 2-token buffer,
    refilled between steps (the worker's work run at the start of each ``propose``)."""
    import tests.speculative.test_spec_sampling as sampling

    made: list[DynamicVocab] = []
    inner_build = sampling.build_drafter

    def build(spec: SpecConfig, target: DecoderModel, slots: int, max_len: int) -> Eagle3Drafter | DraftModelDrafter:
        drafter = inner_build(spec, target, slots, max_len)
        assert isinstance(drafter, (Eagle3Drafter, DraftModelDrafter))
        lm = target.lm_head.weight.detach()
        cfg = DynamicVocabConfig(core_size=3, semantic_k=2, graph=GraphConfig(min_count=1, tau=0.0),
                                 buffer=ArcConfig(capacity=2, max_insert=2, min_residency=1, warmup_events=0))
        if isinstance(drafter, Eagle3Drafter):
            eagle = drafter
            rows_for = lambda ids: eagle.head.output_rows(ids, lm)  # noqa: E731
        else:
            rows_for = lambda ids: lm[ids]  # noqa: E731 - the truncated target shares its LM head
        vocab = DynamicVocab(cfg, [0, 3, 1], rows_for, index=MipsIndex.build(lm), start=False)
        drafter.vocab = vocab
        made.append(vocab)
        propose = drafter.propose

        def propose_between_steps(inputs):  # type: ignore[no-untyped-def]
            vocab.process_pending()
            return propose(inputs)

        drafter.propose = propose_between_steps  # type: ignore[method-assign]
        return drafter

    monkeypatch.setattr(sampling, "build_drafter", build)
    return made


# the deviation of the broken draft probabilities below, measured at 20,000 samples: w^2 = 0.0066
# (w = 0.081); every case samples what catches it with power 0.99 (``sampling.sample_size``: 14,000)
W_UNNORMALISED = 0.081


# make test-slow (48 s): make test checks EAGLE-3 over a changing vocabulary greedy-identical to plain
# decoding (tests/speculative/test_embedded_lossless.py); the broken verifier and the draft model's too
@pytest.mark.parametrize("drafter,broken", [pytest.param("eagle3", False, marks=pytest.mark.slow, id="eagle3-False"),
                                            pytest.param("eagle3", True, marks=pytest.mark.slow, id="eagle3-broken"),
                                            pytest.param("draft-model", False, marks=pytest.mark.slow,
                                                         id="draft-model")])
def test_sampling_with_a_dynamic_v_t_has_the_targets_distribution(drafter: str, broken: bool,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Chi-squared over the first three sampled tokens (rejection sampling, no seed). Broken: the
    draft probabilities reported to the verifier are not renormalised over V_t (scaled by |V_t| / V,
    as if the softmax had run over the whole vocabulary), which the test must catch."""
    import tests.speculative.test_spec_sampling as sampling

    model = tiny_llama(sampling.V, layers=3, seed=4, scale=1.5)
    torch.manual_seed(0)  # the fresh EAGLE-3 head: the same whatever ran before (the sample is then deterministic)
    made = _sampling_vocab_drafter(monkeypatch, model)
    if broken:
        draw = Eagle3Drafter._draw

        def unnormalised(self, logits, ids, params, gen, position):  # type: ignore[no-untyped-def]
            tok, full = draw(self, logits, ids, params, gen, position)
            if full is not None:  # q no longer sums to 1 over V_t: as if normalised over all V tokens
                full = full * (ids.numel() / sampling.V)
            return tok, full

        monkeypatch.setattr(Eagle3Drafter, "_draw", unnormalised)
    params = SamplingParams(temperature=1.0, top_p=1.0)
    dist = sampling.exact_distribution(model, list(sampling.PROMPT), params)
    n = sampling.sample_size(dist, W_UNNORMALISED)
    spec = SpecConfig(drafter=drafter, num_speculative_tokens=3, options={"draft-model": DraftModelOptions(layers=1)})
    samples, accepted, _ = sampling.sample_first3(model, sampling.tiny_tokenizer(sampling.V), list(sampling.PROMPT),
                                                  spec, params, monkeypatch, seeded=False, n=n)
    assert accepted > n // 20 and made[0].stats.published > 0 and made[0].stats.oov_events > 0
    p = sampling.chi2_pvalue(samples, dist)
    assert (p < sampling.ALPHA) if broken else (p > sampling.ALPHA), f"chi2 p={p:.2e} ({n} samples)"


def test_draft_vocab_options_are_validated_and_need_eagle3(target: DecoderModel) -> None:
    with pytest.raises(ConfigError, match="mode"):
        DraftVocabConfig(mode="huge")
    with pytest.raises(ConfigError, match="corpus"):
        DraftVocabConfig(corpus=" , ")
    with pytest.raises(ConfigError, match="draft_vocab_core|core"):
        DraftVocabConfig(core=-1)
    with pytest.raises(ConfigError, match="eagle3"):
        attach_draft_vocab(None, DraftVocabConfig(mode="static"), target, tiny_tokenizer(V))
    assert attach_draft_vocab(None, DraftVocabConfig(), target, tiny_tokenizer(V)) is None  # mode off
