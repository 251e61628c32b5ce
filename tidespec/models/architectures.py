"""The architectures tidespec runs: one row per HF architecture, shared by the config parser and the GGUF converter.

Why this exists: which checkpoints load, which family module runs them and how they differ was
kept in two lists (the model's and the GGUF loader's) and in booleans of the config parser
(``arch == "Qwen2ForCausalLM"``). One table now answers it for ``TargetConfig.from_hf`` (the
family differences a config does not spell out), ``models/loading/gguf_convert.py`` (which GGUF
``general.architecture`` values convert, under which gguf-py tensor names, whether llama.cpp
permuted q/k) and ``models/families`` (which module builds the model). Adding an architecture of
an existing family is one row here; a new family is a row plus its module (docs/architecture.md).

Worked example::

    ARCHITECTURES["Qwen2ForCausalLM"].attention_bias     # True: q/k/v biases by default
    GGUF_ARCHITECTURES["llama"].gguf_permuted_qk         # True: llama.cpp permuted q/k rows for its rope
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Architecture:
    """One HF architecture: the family module that runs it and its differences within the family."""

    hf_class: str  # config.json's architectures[0]
    family: str = "llama"  # the module under models/families/ that builds it
    attention_bias: bool = False  # q/k/v projections carry biases unless config.json says otherwise
    qk_norm: bool = False  # RMSNorm on q and k per head
    gguf: tuple[str, ...] = ()  # GGUF general.architecture values converted to it
    gguf_tensor_names: str = "llama"  # the gguf-py architecture whose tensor names its GGUF files use
    gguf_permuted_qk: bool = False  # llama.cpp's converter permuted q/k rows (undone on conversion)


ARCHITECTURES: dict[str, Architecture] = {a.hf_class: a for a in (
    Architecture("LlamaForCausalLM", gguf=("llama",), gguf_permuted_qk=True),
    # llama.cpp writes Mistral models as "llama"; a "mistral" file names its tensors as llama does
    Architecture("MistralForCausalLM", gguf=("mistral",)),
    Architecture("Qwen2ForCausalLM", attention_bias=True, gguf=("qwen2",), gguf_tensor_names="qwen2"),
    Architecture("Qwen3ForCausalLM", qk_norm=True, gguf=("qwen3",), gguf_tensor_names="qwen3"),
)}
GGUF_ARCHITECTURES: dict[str, Architecture] = {g: a for a in ARCHITECTURES.values() for g in a.gguf}
