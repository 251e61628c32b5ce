"""Runs the (not thread-safe) ``LLMEngine`` in one background thread and streams its outputs to asyncio.

Why this exists: the HTTP server lives on an asyncio event loop, the engine must be driven by one
thread that owns it. ``AsyncEngine`` is the only bridge between the two:

* **engine thread** (``_loop``): applies queued commands (add, abort, arbitrary calls) *between*
  steps, steps while there is work, and hands each step's ``RequestOutput``s to the event loop
  with one ``loop.call_soon_threadsafe`` per step. It blocks on the command queue when idle.
* **event loop**: ``add_request`` enqueues an add and awaits its outcome (so ``RequestError``,
  ``SamplingParamsError`` and ``QueueFullError`` surface synchronously to the HTTP handler, before
  any byte of the response); outputs arrive in the request's ``asyncio.Queue`` and are read
  through ``RequestStream``.
* **preparation worker** (``prep``, one thread): chat templates and tokenization of text prompts
  (``prepare``), so a huge prompt delays only its own request: not the engine's steps, not the
  event loop (``/health``, other streams).

Only the engine thread has an OpenMP team (``tidespec.threads``): it sets the intra-op thread count
of the thread that built the engine when it starts, the preparation worker runs with one, and the
server's main thread gives its team back before serving (``serve``'s ``release_team``).

Bounded memory: at most ``max_in_flight`` requests (running + waiting + being added) exist; one
more raises ``QueueFullError`` at once, without touching the engine (the server answers 429).

Failures: an exception while stepping fails only the requests it is attributable to — those named
by the exception's ``request_ids``/``request_id`` or ``seq_ids``/``seq_id`` attributes, or the only
request in flight — and otherwise every in-flight request; they are aborted in the engine (their
KV freed), their streams end with ``EngineRequestError``, the error is logged and the loop goes on.

Worked example (inside a coroutine)::

    aengine = AsyncEngine(engine)
    aengine.start(asyncio.get_running_loop())
    stream = await aengine.add_request("Hello", SamplingParams(max_tokens=8))
    async for out in stream:          # RequestOutput per step; the last has finished=True
        print(out.delta_text, end="")
    await aengine.shutdown()
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import logging
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from tidespec.engine.engine import LLMEngine, RequestError
from tidespec.engine.output import RequestOutput
from tidespec.engine.scheduler import QueueFullError
from tidespec.sampling import SamplingParams
from tidespec.threads import helper_init, pin_threads

log = logging.getLogger("tidespec.server")

T = TypeVar("T")


class EngineRequestError(RuntimeError):
    """The engine failed while serving this request (the server keeps running)."""


class EngineStoppedError(RuntimeError):
    """The engine loop is not running (not started yet, or shut down)."""


class RequestStream:
    """Async iterator over one request's ``RequestOutput``s; ends after the finished one.

    Raises ``EngineRequestError`` from ``__anext__`` if the engine failed the request.
    """

    def __init__(self, request_id: str, label: str | None) -> None:
        self.request_id = request_id
        self.label = label
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False
        self.last: RequestOutput | None = None
        self.moved = asyncio.Event()  # set by its first output or failure (its prompt was then prefilled)

    def put(self, item: RequestOutput | BaseException) -> None:
        """Hand it an output or its failure (on the event loop)."""
        self.queue.put_nowait(item)
        self.moved.set()

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.last = item
        if item.finished:
            self.finished = True
        return item

    async def get(self, timeout: float | None = None) -> RequestOutput | None:
        """The next output, or None after ``timeout`` seconds without one (StopAsyncIteration at the end)."""
        try:
            return await asyncio.wait_for(self.__anext__(), timeout)
        except asyncio.TimeoutError:
            return None


@dataclasses.dataclass
class _Add:
    request_id: str
    prompt: list[int]  # tokenized by the preparation worker
    params: SamplingParams
    spec_tokens: int | None
    label: str | None
    fit_max_tokens: bool  # max_tokens := whatever context the prompt leaves
    future: concurrent.futures.Future[str]


@dataclasses.dataclass
class _Abort:
    request_id: str


@dataclasses.dataclass
class _Call:
    fn: Callable[[LLMEngine], Any]
    future: concurrent.futures.Future[Any]


@dataclasses.dataclass
class _Stop:
    pass


Command = _Add | _Abort | _Call | _Stop


class AsyncEngine:
    """Owns an ``LLMEngine`` in one thread; see the module docstring."""

    def __init__(self, engine: LLMEngine, max_in_flight: int | None = None, idle_poll_s: float = 0.5,
                 on_finished: Callable[[RequestOutput, str | None], None] | None = None,
                 on_idle: Callable[[LLMEngine], None] | None = None,
                 idle_work: Callable[[LLMEngine], bool] | None = None) -> None:
        if max_in_flight is None:
            mw = engine.config.scheduler.max_waiting
            max_in_flight = engine.config.cache.max_num_seqs + mw if mw else None
        if max_in_flight is not None and max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        self.engine = engine
        self.max_in_flight = max_in_flight
        self.idle_poll_s = idle_poll_s
        self.on_finished = on_finished  # called in the engine thread for every finished request
        self.on_idle = on_idle  # called in the engine thread when it runs out of work
        # called in the engine thread, again and again while it has no requests, until it returns
        # False (then the thread waits for commands); each call must return within a few tens of
        # ms, since a request that arrives meanwhile waits for it (the exactness checker's ticks)
        self.idle_work = idle_work
        self._commands: queue.Queue[Command] = queue.Queue()
        self._streams: dict[str, RequestStream] = {}  # event-loop thread only
        self._labels: dict[str, str | None] = {}  # engine thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.peak_in_flight = 0
        self.num_step_errors = 0
        # prompt preparation (chat templates, tokenization) runs here: never on the engine thread,
        # where it would stall every stream, nor on the event loop; one worker bounds it
        self.prep: concurrent.futures.ThreadPoolExecutor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="tidespec-prep", initializer=helper_init)

    # ------------------------------------------------------------------ lifecycle
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._thread is not None:
            raise RuntimeError("AsyncEngine already started")
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="tidespec-engine", daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the loop after the current step; in-flight requests are aborted and their streams fail."""
        if self._thread is None:
            return
        self._commands.put(_Stop())
        thread, self._thread = self._thread, None
        await asyncio.get_running_loop().run_in_executor(None, thread.join, timeout)
        self.prep.shutdown(wait=False, cancel_futures=True)
        for stream in list(self._streams.values()):
            stream.put(EngineStoppedError("the server is shutting down"))
        self._streams.clear()

    # ------------------------------------------------------------------ event-loop API
    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    async def add_request(self, prompt: str | list[int], params: SamplingParams, *,
                          spec_tokens: int | None = None, label: str | None = None,
                          fit_max_tokens: bool = False, prefix: str = "req") -> RequestStream:
        """Queue a request and return its stream once the engine accepted it.

        Raises ``QueueFullError`` (too many in flight), ``RequestError`` / ``SamplingParamsError`` /
        ``GrammarError`` (the engine refused it) or ``EngineStoppedError``. A constrained request's
        grammar is compiled on the preparation worker first (the request waits, other requests' steps
        go on). With ``fit_max_tokens`` the request may
        generate up to the end of the context (``params.max_tokens`` is replaced).
        """
        if not self.running:
            raise EngineStoppedError("the engine is not running")
        if self.max_in_flight is not None and len(self._streams) >= self.max_in_flight:
            raise QueueFullError(f"server is at capacity ({self.max_in_flight} requests in flight); retry later")
        rid = f"{prefix}-{uuid.uuid4().hex}"
        stream = RequestStream(rid, label)
        self._streams[rid] = stream  # counts against max_in_flight while its prompt is prepared
        self.peak_in_flight = max(self.peak_in_flight, len(self._streams))
        try:
            ids = (await self.prepare(self.engine.tokenizer.encode, prompt, add_special_tokens=False)
                   if isinstance(prompt, str) else list(prompt))
            if params.structured is not None:  # compiled here (cached), so the engine's thread never compiles
                await self.prepare(self.engine.grammars.compile, params.structured)
        except BaseException:
            self._streams.pop(rid, None)
            raise
        fut: concurrent.futures.Future[str] = concurrent.futures.Future()
        self._commands.put(_Add(rid, ids, params, spec_tokens, label, fit_max_tokens, fut))
        try:
            await asyncio.wrap_future(fut)
        except BaseException:
            self._streams.pop(rid, None)
            if not fut.done() or fut.cancelled() or fut.exception() is None:
                self._commands.put(_Abort(rid))  # we were cancelled while the add was pending: undo it
            raise
        return stream

    async def prepare(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run prompt preparation ``fn(*args, **kwargs)`` (a chat template, tokenization) on the
        preparation worker, off the event loop and off the engine thread."""
        return await asyncio.get_running_loop().run_in_executor(self.prep, functools.partial(fn, *args, **kwargs))

    def abort(self, request_id: str) -> None:
        """Abort a request (idempotent; a no-op once it finished). Frees its KV in the engine thread."""
        if self._streams.pop(request_id, None) is not None:
            self._commands.put(_Abort(request_id))

    def call(self, fn: Callable[[LLMEngine], T]) -> concurrent.futures.Future[T]:
        """Run ``fn(engine)`` in the engine thread between steps (thread-safe, from any thread)."""
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        if not self.running:
            fut.set_exception(EngineStoppedError("the engine is not running"))
            return fut
        self._commands.put(_Call(fn, fut))
        return fut

    def _deliver(self, outputs: list[RequestOutput], errors: dict[str, BaseException]) -> None:
        """Event-loop side of one step: route outputs and failures to their streams."""
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # aborted by the client meanwhile
            stream.put(out)
            if out.finished:
                del self._streams[out.request_id]
        for rid, exc in errors.items():
            stream = self._streams.pop(rid, None)
            if stream is not None:
                stream.put(exc)

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        # the engine thread steps with the intra-op threads of the thread that built the engine
        # (LLMEngine.intraop_threads): a thread started later would take PyTorch's last
        # set_num_threads value, which a helper thread may have lowered to 1 (tidespec.threads)
        pin_threads(self.engine.intraop_threads)
        eng = self.engine
        stop = False
        idle_pending = False  # idle work left over from the last idle call
        while not stop:
            busy = eng.has_unfinished_requests()
            stop = self._apply_commands(block=not busy and not idle_pending)
            if stop or not eng.has_unfinished_requests():
                if not stop and busy and self.on_idle is not None:
                    self._safe(self.on_idle, eng)
                if not stop and self.idle_work is not None:
                    idle_pending = self._idle_work(eng)
                continue
            idle_pending = self.idle_work is not None  # finished requests may have left idle work
            try:
                outputs = eng.step()
            except Exception as exc:  # noqa: BLE001 - one bad step must not kill the server
                self._fail_step(exc)
                continue
            for out in outputs:
                if out.finished:
                    self._finished(out)
            if outputs:
                self._post(outputs, {})
        self._abort_all(EngineStoppedError("the server is shutting down"))

    def _apply_commands(self, block: bool) -> bool:
        """Apply queued commands; when ``block``, wait for the first one. True once asked to stop."""
        try:
            cmd: Command | None = self._commands.get(timeout=self.idle_poll_s) if block else self._commands.get_nowait()
        except queue.Empty:
            return False
        while cmd is not None:
            if isinstance(cmd, _Stop):
                return True
            self._apply(cmd)
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                cmd = None
        return False

    def _apply(self, cmd: Command) -> None:
        eng = self.engine
        if isinstance(cmd, _Add):
            if not cmd.future.set_running_or_notify_cancel():
                return
            try:
                params = cmd.params
                if cmd.fit_max_tokens:
                    params = dataclasses.replace(params, max_tokens=max(1, eng.max_model_len - len(cmd.prompt)))
                rid = eng.add_request(cmd.prompt, params, request_id=cmd.request_id, spec_tokens=cmd.spec_tokens,
                                      label=cmd.label)
            except Exception as exc:  # noqa: BLE001 - handed to the caller, who maps it to 4xx/5xx
                cmd.future.set_exception(exc)
                return
            self._labels[rid] = cmd.label
            cmd.future.set_result(rid)
        elif isinstance(cmd, _Abort):
            self._abort_one(cmd.request_id)
        elif isinstance(cmd, _Call):
            if not cmd.future.set_running_or_notify_cancel():
                return
            try:
                cmd.future.set_result(cmd.fn(eng))
            except Exception as exc:  # noqa: BLE001 - handed to the caller
                cmd.future.set_exception(exc)

    def _abort_one(self, request_id: str) -> None:
        seq = self.engine.seqs.get(request_id)
        try:
            aborted = self.engine.abort_request(request_id)
        except Exception:  # noqa: BLE001 - keep the loop alive; log for the operator
            log.exception("aborting request %s failed", request_id)
            return
        if aborted and seq is not None:
            out = RequestOutput(request_id, list(seq.prompt_ids), list(seq.output_ids), seq.emitted_text, "", [],
                                True, "abort", seq.stats)
            self._finished(out)

    def _finished(self, out: RequestOutput) -> None:
        label = self._labels.pop(out.request_id, None)
        if self.on_finished is not None:
            self._safe(self.on_finished, out, label)

    def _fail_step(self, exc: Exception) -> None:
        """A step raised: fail the requests it is attributable to (else all in flight), keep going."""
        self.num_step_errors += 1
        eng = self.engine
        in_flight = list(eng.seqs)
        culprits = _attributed(exc, eng)
        if not culprits and len(in_flight) == 1:
            culprits = set(in_flight)
        targets = [r for r in in_flight if r in culprits] if culprits else in_flight
        log.error("engine step failed (%s: %s); failing %d of %d in-flight request(s)",
                  type(exc).__name__, exc, len(targets), len(in_flight), exc_info=exc)
        err = EngineRequestError(f"internal engine error: {type(exc).__name__}: {exc}".splitlines()[0])
        for rid in targets:
            self._abort_one(rid)
        self._post([], {rid: err for rid in targets})
        if self.on_idle is not None and not eng.has_unfinished_requests():  # no step will refresh the load gauges
            self._safe(self.on_idle, eng)

    def _abort_all(self, exc: BaseException) -> None:
        targets = list(self.engine.seqs)
        for rid in targets:
            self._abort_one(rid)
        self._post([], {rid: exc for rid in targets})

    def _post(self, outputs: list[RequestOutput], errors: dict[str, BaseException]) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(self._deliver, outputs, errors)
        except RuntimeError:  # the loop closed between the check and the call
            log.warning("event loop closed; dropped %d output(s)", len(outputs))

    def _idle_work(self, eng: LLMEngine) -> bool:
        """One idle-work call; a failure is logged and stops idle work until the next request."""
        assert self.idle_work is not None
        try:
            return bool(self.idle_work(eng))
        except Exception:  # noqa: BLE001 - idle work must not stop the engine
            log.exception("idle work %r failed", self.idle_work)
            return False

    @staticmethod
    def _safe(fn: Callable[..., Any], *args: Any) -> None:
        try:
            fn(*args)
        except Exception:  # noqa: BLE001 - a metrics hook must not stop the engine
            log.exception("engine hook %r failed", fn)


def _attr_values(exc: BaseException, attrs: tuple[str, str], kind: type) -> set[Any]:
    """Values of type ``kind`` an exception carries in either attribute (a single value or a collection)."""
    found: set[Any] = set()
    for attr in attrs:
        v = getattr(exc, attr, None)
        if isinstance(v, kind):
            found.add(v)
        elif isinstance(v, (list, tuple, set, frozenset)):
            found.update(x for x in v if isinstance(x, kind))
    return found


def _attributed(exc: BaseException, eng: LLMEngine) -> set[str]:
    """Request ids an exception names via ``request_id(s)`` or ``seq_id(s)`` attributes."""
    rids: set[str] = _attr_values(exc, ("request_ids", "request_id"), str)
    seq_ids: set[int] = _attr_values(exc, ("seq_ids", "seq_id"), int)
    if seq_ids:
        rids.update(rid for rid, seq in eng.seqs.items() if seq.seq_id in seq_ids)
    return {r for r in rids if r in eng.seqs}


__all__ = ["AsyncEngine", "EngineRequestError", "EngineStoppedError", "QueueFullError", "RequestError",
           "RequestStream"]
