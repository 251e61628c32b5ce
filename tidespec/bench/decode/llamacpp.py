"""llama.cpp (through llama-cpp-python) as a reference engine for ``tidespec bench decode --compare llamacpp``.

Why this exists: a user who runs a small model on a CPU compares us with llama.cpp, so the
decode benchmark measures it on the same GGUF file tidespec loaded (tidespec dequantizes it; llama.cpp
runs the quantized weights as shipped), on the same prompt token ids, with the same number of
threads, greedy, batch 1, exactly ``max_tokens`` tokens. llama-cpp-python is not a dependency of
tidespec (it builds llama.cpp from source, ~15 minutes on 2 cores; one-time:
``.venv/bin/pip install llama-cpp-python==0.3.36``), so everything here degrades to a one-line
notice when it is missing or when the target is not a GGUF file.

Method. ``Llama.generate`` is driven directly with the prompt's token ids: ``temp=0`` selects
llama.cpp's greedy sampler (``repeat_penalty=1`` keeps the penalty stage a no-op); the generator
never stops at EOS itself (only ``create_completion`` does), so taking exactly ``max_tokens``
tokens from it ignores EOS as tidespec's ``ignore_eos`` does. ``reset()`` before each prompt empties
the KV cache, so a repeated prompt gets no prefix-cache hit and every run pays its full prefill.
The generator yields a token before evaluating it, so ``n`` tokens cost one prefill plus
``n - 1`` single-token evaluations — the same forwards tidespec and HF ``generate()`` run. TTFT is
the time to the first yielded token.

A crash guard. llama.cpp built natively uses the CPU's AMX tiles when CPUID reports them (its
"extra buffer types", which also hold repacked weights); on a VM whose CPUID advertises AMX
that the hypervisor does not really provide, the first matmul dies with SIGSEGV in
``ggml_backend_amx_mul_mat`` (seen on the 2-core development VM), which would take the whole
benchmark down. So a child process first evaluates the prompt with llama.cpp's defaults; only if
that child dies is the model loaded with ``use_extra_bufts = False`` (plain ggml CPU kernels: no
AMX, no weight repacking), and the report says so (``LlamaCppRunner.settings``).

Worked example::

    gguf, reason = target_gguf(None, loaded_path=None)     # the embedded Q4_1 GGUF, ""
    runner, notice = open_llamacpp(gguf, reason, n_ctx=512, n_threads=2, n_batch=512, probe_ids=[1, 2, 3])
    run = runner.generate([1, 2, 3], max_tokens=4) if runner else None   # LlamaCppRun(token_ids=[...], ...)
    runner.settings()["extra_buffer_types"]               # False where the default kernels crashed
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tidespec.models.loading.loader import ModelLoadError, converted_dir_for, resolve_embedded_gguf

LLAMACPP_VERSION = "0.3.36"
INSTALL_HINT = f".venv/bin/pip install llama-cpp-python=={LLAMACPP_VERSION} (builds llama.cpp from source, ~15 min)"
_GGUF_MAGIC = b"GGUF"
PROBE_TIMEOUT_S = 180.0
# Child-process probe: load with llama.cpp's defaults, evaluate the prompt (argv[2]) and one token.
_PROBE = ("import sys, llama_cpp\n"
          "ids = [int(x) for x in sys.argv[2].split(',')]\n"
          "llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=len(ids) + 8, n_batch=len(ids) + 8, n_threads=1,"
          " verbose=False)\n"
          "llm.eval(ids)\n"
          "llm.eval(ids[-1:])\n")


@dataclass
class LlamaCppRun:
    """One greedy generation by llama.cpp: the tokens and when they came (seconds from the call)."""

    token_ids: list[int] = field(repr=False)
    ttft: float
    latency: float


def _is_gguf_file(path: Path) -> bool:
    try:
        with path.open("rb") as fh:
            return fh.read(4) == _GGUF_MAGIC
    except OSError:
        return False


def target_gguf(model: str | None, loaded_path: str | None) -> tuple[Path | None, str]:
    """The GGUF file behind the benchmark's target, or ``(None, why not)``.

    ``model`` is what ``--model`` named (None = the embedded model); ``loaded_path`` is the HF
    directory of an already-loaded target (None when the bench loads ``model`` itself): then the
    GGUF counts only if that directory is its cached conversion, so a model built some other way is
    never compared with an unrelated file.

    Examples: ``target_gguf(None, None)`` -> (``.../SmolLM2-135M-Instruct.Q4_1.gguf``, "");
    ``target_gguf("ckpt_dir", None)`` -> (None, "the target ckpt_dir is not a GGUF file ...").
    """
    try:
        src = resolve_embedded_gguf() if model is None else Path(model).expanduser()
    except ModelLoadError as exc:
        return None, str(exc)
    gguf: Path | None = None
    if src.is_file() and _is_gguf_file(src):
        gguf = src
    elif src.is_dir() and not (src / "config.json").is_file():
        found = sorted(src.glob("*.gguf"))
        gguf = found[0] if len(found) == 1 and _is_gguf_file(found[0]) else None
    if gguf is None:
        return None, f"the target {src} is not a GGUF file (llama.cpp runs GGUF files only)"
    if loaded_path is not None and Path(loaded_path) not in (converted_dir_for(gguf), converted_dir_for(gguf, floats=False)):
        return None, f"the target was not loaded from a GGUF file (its weights come from {loaded_path or 'memory'})"
    return gguf, ""


class LlamaCppRunner:
    """A ``llama_cpp.Llama`` on one GGUF file, generating greedily from token ids at batch 1."""

    def __init__(self, llm: Any, gguf_path: Path, n_threads: int, extra_buffer_types: bool = True,
                 note: str = "") -> None:
        self.llm = llm
        self.gguf_path = gguf_path
        self.n_threads = n_threads
        self.extra_buffer_types = extra_buffer_types
        self.note = note  # why the extra buffer types are off, "" when they are on
        self._contexts: dict[int, Any] = {}  # sequence count -> llama_context* (generate_batch)

    def settings(self) -> dict[str, Any]:
        """What the report records of this llama.cpp instance."""
        import llama_cpp

        return {"gguf": str(self.gguf_path), "llama_cpp_python": getattr(llama_cpp, "__version__", "?"),
                "n_threads": self.n_threads, "n_ctx": self.llm.n_ctx(), "n_batch": self.llm.n_batch,
                "extra_buffer_types": self.extra_buffer_types, "note": self.note}

    def generate_batch(self, prompts: list[list[int]], max_tokens: int) -> list[LlamaCppRun]:
        """Exactly ``max_tokens`` greedy tokens after each prompt (EOS ignored), the prompts decoded
        together as llama-server's parallel slots decode them: one context of ``len(prompts)``
        sequences on the same model with the ``Llama``'s settings (a KV cache per sequence, emptied per
        call), the prompts' tokens in
        ``llama_decode`` calls of up to ``n_batch`` tokens (logits at each prompt's last token), then one
        call per step with every sequence's last token. Greedy = the first maximum of the logits, as
        llama.cpp's greedy sampler takes. A sequence's TTFT is when its first token was taken.
        (llama-cpp-python's ``Llama`` decodes one sequence; this drives its C API directly.)"""
        import llama_cpp
        import numpy as np

        lib, n = llama_cpp, len(prompts)  # the package re-exports the C API (llama_cpp.llama_cpp)
        ctx = self._context(lib, n)
        n_vocab = self.llm.n_vocab()
        lib.llama_memory_clear(lib.llama_get_memory(ctx), True)
        batch = lib.llama_batch_init(max(self.llm.n_batch, n), 0, 1)
        out: list[list[int]] = [[] for _ in prompts]
        first = [0.0] * n
        try:
            t0 = time.perf_counter()
            work = [(s, pos, tok) for s, ids in enumerate(prompts) for pos, tok in enumerate(ids)]
            while work:  # prefill in n_batch chunks; a prompt ending in a chunk gets its first token
                chunk, work = work[:self.llm.n_batch], work[self.llm.n_batch:]
                ends = [(j, s) for j, (s, pos, _) in enumerate(chunk) if pos == len(prompts[s]) - 1]
                self._decode(lib, ctx, batch, chunk, {j for j, _ in ends})
                now = time.perf_counter()
                for j, s in ends:
                    out[s].append(int(np.argmax(np.ctypeslib.as_array(lib.llama_get_logits_ith(ctx, j), (n_vocab,)))))
                    first[s] = now - t0
            for _ in range(max_tokens - 1):
                step = [(s, len(prompts[s]) + len(out[s]) - 1, out[s][-1]) for s in range(n)]
                self._decode(lib, ctx, batch, step, set(range(n)))
                for s in range(n):
                    out[s].append(int(np.argmax(np.ctypeslib.as_array(lib.llama_get_logits_ith(ctx, s), (n_vocab,)))))
            t1 = time.perf_counter()
        finally:
            lib.llama_batch_free(batch)
        return [LlamaCppRun(tokens, ttft, t1 - t0) for tokens, ttft in zip(out, first)]

    def _context(self, lib: Any, n_seq: int) -> Any:
        """A llama.cpp context for ``n_seq`` sequences of ``n_ctx`` tokens each on this runner's model
        (made once per sequence count, freed with the runner's ``close``)."""
        if n_seq not in self._contexts:  # the Llama's own settings (flash attention off, ...), n_seq sequences
            base = self.llm.context_params
            params = type(base).from_buffer_copy(base)
            params.n_ctx = self.llm.n_ctx() * n_seq
            params.n_seq_max = n_seq
            params.kv_unified = False  # a KV stream per sequence: 1.1x the unified cache's decode speed here
            ctx = lib.llama_init_from_model(self.llm.model, params)
            if ctx is None:
                raise RuntimeError(f"llama.cpp could not make a context for {n_seq} sequences")
            self._contexts[n_seq] = ctx
        return self._contexts[n_seq]

    @staticmethod
    def _decode(lib: Any, ctx: Any, batch: Any, tokens: list[tuple[int, int, int]], logits: set[int]) -> None:
        """One ``llama_decode`` of ``tokens`` = (sequence, position, token id), logits where listed."""
        for j, (s, pos, tok) in enumerate(tokens):
            batch.token[j], batch.pos[j], batch.n_seq_id[j], batch.logits[j] = tok, pos, 1, j in logits
            batch.seq_id[j][0] = s
        batch.n_tokens = len(tokens)
        rc = lib.llama_decode(ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def close(self) -> None:
        """Free the batched contexts and the ``Llama`` (before the interpreter's shutdown, where
        llama-cpp-python's own finalizer fails)."""
        import llama_cpp

        for ctx in self._contexts.values():
            llama_cpp.llama_free(ctx)
        self._contexts.clear()
        close = getattr(self.llm, "close", None)
        if close is not None:
            close()

    def generate(self, token_ids: list[int], max_tokens: int) -> LlamaCppRun:
        """Exactly ``max_tokens`` greedy tokens after ``token_ids`` (EOS ignored), full prefill."""
        self.llm.reset()  # empty KV cache: no prefix reuse from the previous prompt
        out: list[int] = []
        t0 = time.perf_counter()
        first = t0
        gen = self.llm.generate(token_ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True)
        try:
            for tok in gen:
                out.append(int(tok))
                if len(out) == 1:
                    first = time.perf_counter()
                if len(out) >= max_tokens:
                    break
        finally:
            gen.close()
        t1 = time.perf_counter()
        return LlamaCppRun(out, first - t0, t1 - t0)


def probe_default_kernels(gguf: Path, token_ids: list[int], timeout_s: float = PROBE_TIMEOUT_S) -> str:
    """Evaluate ``token_ids`` with llama.cpp's default settings in a child process: "" when it
    works, else one line saying how it failed (e.g. killed by SIGSEGV)."""
    ids = ",".join(str(t) for t in (token_ids or [0]))
    try:
        proc = subprocess.run([sys.executable, "-c", _PROBE, str(gguf), ids], capture_output=True, text=True,
                              timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        return f"a probe with llama.cpp's default kernels did not finish in {timeout_s:.0f} s"
    if proc.returncode == 0:
        return ""
    if proc.returncode < 0:
        try:
            how = signal.Signals(-proc.returncode).name
        except ValueError:
            how = f"signal {-proc.returncode}"
        return f"llama.cpp's default kernels crash on this CPU (probe killed by {how}; AMX advertised but unusable?)"
    tail = proc.stderr.strip().splitlines()
    last = " ".join(tail[-1].split()) if tail else f"exit code {proc.returncode}"
    return f"a probe with llama.cpp's default kernels failed: {last}"


@contextlib.contextmanager
def _without_extra_buffer_types(llama_cpp_module: Any) -> Iterator[None]:
    """While a ``Llama`` is constructed, its model params get ``use_extra_bufts = False``
    (``Llama.__init__`` takes no such argument; it reads ``llama_model_default_params()``)."""
    lib = llama_cpp_module.llama_cpp
    original = lib.llama_model_default_params

    def defaults() -> Any:
        params = original()
        params.use_extra_bufts = False
        return params

    lib.llama_model_default_params = defaults
    try:
        yield
    finally:
        lib.llama_model_default_params = original


def open_llamacpp(gguf: Path | None, reason: str, *, n_ctx: int, n_threads: int, n_batch: int,
                  probe_ids: list[int] | None = None) -> tuple[LlamaCppRunner | None, str]:
    """``(runner, "")`` when llama-cpp-python is importable and loads ``gguf``; else
    ``(None, one-line notice)`` saying why llama.cpp is skipped (``reason`` when ``gguf`` is None).
    With ``probe_ids`` (a prompt), llama.cpp's default kernels are first tried in a child process
    and turned off if they crash there (see the module docstring)."""
    skip = "llama.cpp comparison skipped: "
    if gguf is None:
        return None, skip + reason
    try:
        import llama_cpp
    except (ImportError, OSError, RuntimeError) as exc:  # not installed, or its shared library fails to load
        detail = "llama-cpp-python is not installed" if isinstance(exc, ImportError) else \
            f"llama-cpp-python does not load ({_one_line(exc)})"
        return None, f"{skip}{detail}; one-time install: {INSTALL_HINT}"
    note = probe_default_kernels(gguf, probe_ids) if probe_ids is not None else ""
    guard = _without_extra_buffer_types(llama_cpp) if note else contextlib.nullcontext()
    try:
        with guard:
            llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=n_threads, n_threads_batch=n_threads,
                                  n_batch=min(n_batch, n_ctx), verbose=False)
    except (ValueError, RuntimeError, OSError) as exc:
        return None, f"{skip}llama.cpp cannot load {gguf}: {_one_line(exc)}"
    if note:
        note += "; ran with use_extra_bufts=False (plain ggml CPU kernels: no AMX, no weight repacking)"
    return LlamaCppRunner(llm, gguf, n_threads, extra_buffer_types=not note, note=note), ""


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text or type(exc).__name__
