"""Helper threads run PyTorch on one thread; the engine thread keeps its builder's intra-op threads.

Why: an OpenMP team made by any other thread halves the speed of the step's small parallel regions
(``tidespec.threads``); these tests pin the rule, not the speed (tests never time anything).
"""

from __future__ import annotations

import asyncio
import threading

import torch

from tests.helpers import tiny_llama, tiny_tokenizer
from tidespec.config import CacheConfig, EngineConfig
from tidespec.engine.engine import LLMEngine
from tidespec.server.async_engine import AsyncEngine
from tidespec.threads import pin_threads, release_team, start_helper


def _in_thread(fn):  # run fn in a fresh thread (its thread settings never leak into the test's)
    out: dict[str, object] = {}

    def run() -> None:
        out["value"] = fn()

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return out["value"]


def test_helper_runs_on_one_thread_and_leaves_the_caller_alone() -> None:
    seen: list[int] = []

    def builder() -> int:
        pin_threads(2)
        start_helper(lambda: seen.append(torch.get_num_threads()), "test-helper").join()
        return torch.get_num_threads()

    assert _in_thread(builder) == 2
    assert seen == [1]


def test_engine_thread_steps_with_its_builders_threads_after_a_helper_lowered_the_default() -> None:
    def scenario() -> int:
        pin_threads(2)
        engine = LLMEngine(tiny_llama(), tiny_tokenizer(64), EngineConfig(cache=CacheConfig(max_model_len=64,
                                                                                            max_num_seqs=2)))
        aengine = AsyncEngine(engine)
        # a helper started before the engine thread: PyTorch's default for new threads is now 1
        start_helper(lambda: torch.zeros(1), "test-helper").join()
        assert _in_thread(torch.get_num_threads) == 1  # what an unpinned new thread would get

        async def go() -> int:
            aengine.start(asyncio.get_running_loop())
            try:
                return await asyncio.wrap_future(aengine.call(lambda _: torch.get_num_threads()))
            finally:
                await aengine.shutdown()

        return asyncio.run(go())

    assert _in_thread(scenario) == 2


def test_release_team_frees_the_runtimes_threads_and_keeps_one() -> None:
    def scenario() -> tuple[bool, int]:
        pin_threads(2)
        torch.ones(1 << 20).mul_(2.0)  # a parallel region: this thread now has a team
        return release_team(), torch.get_num_threads()

    freed, threads = _in_thread(scenario)
    # PyTorch's OpenMP builds (the Linux wheels, this project's CI) load a runtime that frees it
    assert freed == ("OpenMP" in torch.__config__.parallel_info())
    assert threads == 1


def test_engine_thread_steps_with_its_threads_after_the_builder_released_its_team() -> None:
    """``tidespec serve`` releases the main thread's team (``release_team``: one thread) once the
    engine thread runs; that count reached the engine thread, whose steps then ran on one core
    (measured: a 1,551-token prefill 5.3 s instead of 2.9 s). The engine thread pins its count
    again before a step."""
    from tidespec.sampling import SamplingParams

    def scenario() -> list[int]:
        pin_threads(2)
        seen: list[int] = []
        engine = LLMEngine(tiny_llama(), tiny_tokenizer(64), EngineConfig(cache=CacheConfig(max_model_len=64,
                                                                                            max_num_seqs=2)))
        aengine = AsyncEngine(engine, on_finished=lambda *_: seen.append(torch.get_num_threads()))

        async def go() -> None:
            aengine.start(asyncio.get_running_loop())
            try:
                assert await asyncio.wrap_future(aengine.call(lambda _: torch.get_num_threads())) == 2
                release_team()  # the server's main thread, after the engine thread started
                stream = await aengine.add_request([1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True))
                async for _ in stream:
                    pass
            finally:
                await aengine.shutdown()

        asyncio.run(go())
        return seen

    assert _in_thread(scenario) == [2]
