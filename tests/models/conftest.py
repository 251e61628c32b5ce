"""Fixtures of the model tests: transformers' reference models made honest in float64."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers.models.gemma3 import modeling_gemma3
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
               modeling_mixtral.MixtralRMSNorm)
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


def _gemma_rmsnorm_in_input_dtype(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight)


@pytest.fixture
def honest_hf_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    """HF's RMSNorm forwards cast to float32 internally (``hidden_states.to(torch.float32)``), so an
    unpatched float64 HF model is only float32-accurate and could never meet a 1e-10 bound. Patch
    them to compute in the input dtype (what our RMSNorm does for float64), and the routers of the
    mixtures of experts likewise. Attention uses sdpa,
    which stays in float64 (eager softmax would also downcast); rope cos/sin are computed in
    float32 by both HF and us, so they need no patch."""
    for cls in HF_RMSNORMS:
        monkeypatch.setattr(cls, "forward", _rmsnorm_in_input_dtype)
    monkeypatch.setattr(modeling_gemma3.Gemma3RMSNorm, "forward", _gemma_rmsnorm_in_input_dtype)
    for cls in HF_ROUTERS:  # their softmax is float32 whatever the input: float64 in float64
        monkeypatch.setattr(cls, "forward", _route_in_input_dtype)
