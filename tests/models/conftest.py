"""Fixtures of the model tests: transformers' reference models made honest in float64."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers.models.gemma2 import modeling_gemma2
from transformers.models.gemma3 import modeling_gemma3
from transformers.models.gpt_oss import modeling_gpt_oss
from transformers.models.granite import modeling_granite
from transformers.models.llama import modeling_llama
from transformers.models.mistral import modeling_mistral
from transformers.models.mixtral import modeling_mixtral
from transformers.models.olmo2 import modeling_olmo2
from transformers.models.phi3 import modeling_phi3
from transformers.models.qwen2 import modeling_qwen2
from transformers.models.qwen3 import modeling_qwen3
from transformers.models.qwen3_moe import modeling_qwen3_moe
from transformers.models.smollm3 import modeling_smollm3

HF_RMSNORMS = (modeling_llama.LlamaRMSNorm, modeling_mistral.MistralRMSNorm, modeling_qwen2.Qwen2RMSNorm,
               modeling_qwen3.Qwen3RMSNorm, modeling_smollm3.SmolLM3RMSNorm, modeling_olmo2.Olmo2RMSNorm,
               modeling_granite.GraniteRMSNorm, modeling_phi3.Phi3RMSNorm, modeling_qwen3_moe.Qwen3MoeRMSNorm,
               modeling_mixtral.MixtralRMSNorm, modeling_gpt_oss.GptOssRMSNorm)
HF_ROUTERS = (modeling_qwen3_moe.Qwen3MoeTopKRouter, modeling_mixtral.MixtralTopKRouter)


def _rmsnorm_in_input_dtype(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def _route_in_input_dtype(self: nn.Module, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
    logits = torch.nn.functional.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight)
    top, index = torch.topk(torch.softmax(logits, dim=-1), self.top_k, dim=-1)
    if getattr(self, "norm_topk_prob", True):  # Mixtral's router always renormalizes
        top = top / top.sum(dim=-1, keepdim=True)
    return logits, top.to(logits.dtype), index


def _eager_attention_in_input_dtype(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                    attention_mask: torch.Tensor | None, dropout: float = 0.0,
                                    scaling: float | None = None, softcap: float | None = None,
                                    **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' eager Gemma 2 attention with its softmax in the input dtype (it upcasts to float32 only)."""
    key = modeling_gemma2.repeat_kv(key, module.num_key_value_groups)
    value = modeling_gemma2.repeat_kv(value, module.num_key_value_groups)
    weights = torch.matmul(query, key.transpose(2, 3)) * (scaling if scaling is not None else module.head_dim ** -0.5)
    if softcap is not None:
        weights = torch.tanh(weights / softcap) * softcap
    if attention_mask is not None:
        weights = weights + attention_mask
    weights = torch.softmax(weights, dim=-1)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


def _gemma_rmsnorm_in_input_dtype(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight)


@pytest.fixture
def honest_hf_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    """HF's RMSNorm forwards cast to float32 internally (``hidden_states.to(torch.float32)``), so an
    unpatched float64 HF model is only float32-accurate and could never meet a 1e-10 bound. Patch
    them to compute in the input dtype (what our RMSNorm does for float64), and the routers of the
    mixtures of experts and Gemma 2's eager attention (soft-capped scores) likewise. Attention uses sdpa,
    which stays in float64 (eager softmax would also downcast; gpt-oss's eager attention with sinks and its
    router keep the input dtype); rope cos/sin are computed in
    float32 by both HF and us, so they need no patch."""
    for cls in HF_RMSNORMS:
        monkeypatch.setattr(cls, "forward", _rmsnorm_in_input_dtype)
    for cls in (modeling_gemma2.Gemma2RMSNorm, modeling_gemma3.Gemma3RMSNorm):
        monkeypatch.setattr(cls, "forward", _gemma_rmsnorm_in_input_dtype)
    monkeypatch.setattr(modeling_gemma2, "eager_attention_forward", _eager_attention_in_input_dtype)
    for cls in HF_ROUTERS:  # their softmax is float32 whatever the input: float64 in float64
        monkeypatch.setattr(cls, "forward", _route_in_input_dtype)
