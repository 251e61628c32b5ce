"""Every family's chat template comes from its checkpoint and is rendered as transformers renders it.

A self-hoster's model brings its own template: an HF directory in its tokenizer files, a GGUF in
``tokenizer.chat_template``. The templates here are written for these tests in each family's turn
format, with the features the real ones use: Gemma's refusal of a system turn (``raise_exception``),
Llama 3's date (``strftime_now`` unless the request passes ``date_string``), Qwen3's and SmolLM3's
``enable_thinking``, Mistral's alternation check, gpt-oss's ``reasoning_effort``. The server gets them from the checkpoint it loaded
(no template of its own), passes a request's ``chat_template_kwargs`` to them (vLLM's field), and
answers a template's refusal with a 400 naming ``messages``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest
import torch
import transformers

from tests.helpers import byte_tokenizer, tiny_hf_model
from tests.models.test_gguf_families import CONFIGS, GGUF_ARCH, VOCAB, write_family_gguf
from tests.server.live import LiveServer
from tidespec.config import CacheConfig, EngineConfig
from tidespec.engine.engine import LLMEngine
from tidespec.models.loading.loader import load_model
from tidespec.server.app import ServerConfig, create_app

IM = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
      "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
QWEN3 = IM.replace("assistant\n{% endif %}",  # an empty thought when the request turns thinking off
                   "assistant\n{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
                   "{% endif %}{% endif %}")
SMOLLM3 = ("{% set mode = '/no_think' if enable_thinking is defined and not enable_thinking else '/think' %}"
           "<|im_start|>system\n## Metadata\nReasoning Mode: {{ mode }}\n<|im_end|>\n" + IM)
GEMMA = ("{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
         "{% endif %}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
         "{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
LLAMA3 = ("{{ bos_token }}{% if date_string is not defined %}{% set date_string = strftime_now('%d %b %Y') %}{% endif %}"
          "<|start_header_id|>system<|end_header_id|>\n\nToday Date: {{ date_string }}\n\n"
          "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}{% endif %}<|eot_id|>"
          "{% for m in messages if m['role'] != 'system' %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
          "{{ m['content'] }}<|eot_id|>{% endfor %}"
          "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
PHI3 = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% else %}{{ eos_token }}{% endif %}")
OLMO2 = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
         "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
GRANITE = ("{% for m in messages %}<|start_of_role|>{{ m['role'] }}<|end_of_role|>{{ m['content'] }}<|end_of_text|>\n"
           "{% endfor %}{% if add_generation_prompt %}<|start_of_role|>assistant<|end_of_role|>{% endif %}")
MISTRAL = ("{{ bos_token }}{% for m in messages if m['role'] != 'system' %}"
           "{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
           "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
           "{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]{% else %}{{ m['content'] }}{{ eos_token }}"
           "{% endif %}{% endfor %}")
# gpt-oss's harmony format: a system turn with the reasoning effort (the request's ``reasoning_effort``),
# answers on the final channel
HARMONY = ("{% set effort = reasoning_effort if reasoning_effort is defined else 'medium' %}"
           "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n\n"
           "Reasoning: {{ effort }}\n\n# Valid channels: analysis, commentary, final.<|end|>"
           "{% for m in messages %}{% if m['role'] == 'assistant' %}<|start|>assistant<|channel|>final<|message|>"
           "{{ m['content'] }}<|end|>{% else %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{% endif %}"
           "{% endfor %}{% if add_generation_prompt %}<|start|>assistant{% endif %}")
# tiny arch -> (its family's template, the request's chat_template_kwargs)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama3": (LLAMA3, {"date_string": "26 Jul 2024"}), "qwen3": (QWEN3, {"enable_thinking": False}),
    "qwen3-moe": (QWEN3, {"enable_thinking": False}), "smollm3": (SMOLLM3, {"enable_thinking": False}),
    "gemma2": (GEMMA, {}), "gemma3": (GEMMA, {}), "phi3": (PHI3, {}), "olmo2": (OLMO2, {}), "granite": (GRANITE, {}),
    "mixtral": (MISTRAL, {}), "qwen2": (IM, {}), "gpt-oss": (HARMONY, {})}
# one token, whatever the random model draws (EOS included): every answer ends at its length
ONE_TOKEN: dict[str, Any] = {"ignore_eos": True}
MESSAGES = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Name a colour."}]


def _checkpoint(arch: str, directory: Path) -> Path:
    """A tiny ``arch`` checkpoint saved by transformers with a byte-level tokenizer and its family's template."""
    hf, _ = tiny_hf_model(arch, torch.float32, seed=3, vocab_size=265, max_position_embeddings=512)
    hf.save_pretrained(str(directory))
    tok = byte_tokenizer()
    tok.chat_template = FAMILIES[arch][0]
    tok.save_pretrained(str(directory))
    return directory


def _serve(directory: Path) -> tuple[LiveServer, list[str]]:
    """A live server on the checkpoint in ``directory`` (as ``tidespec serve --model DIR`` loads it) and
    the list the prompts it hands the engine are appended to."""
    loaded = load_model(str(directory))
    engine = LLMEngine(loaded.model, loaded.tokenizer, EngineConfig(cache=CacheConfig(max_model_len=512, max_num_seqs=2)))
    prompts: list[str] = []
    add = engine.add_request

    def spy(prompt: str | list[int], *args: Any, **kwargs: Any) -> str:
        prompts.append(prompt if isinstance(prompt, str) else loaded.tokenizer.decode(prompt))
        return add(prompt, *args, **kwargs)

    engine.add_request = spy  # type: ignore[method-assign]
    return LiveServer(create_app(engine, ServerConfig(served_model_name="tiny"))), prompts


@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_a_family_checkpoint_serves_its_own_chat_template(arch: str, tmp_path: Path) -> None:
    directory = _checkpoint(arch, tmp_path / arch)
    kwargs = FAMILIES[arch][1]
    reference = transformers.AutoTokenizer.from_pretrained(str(directory))
    server, prompts = _serve(directory)
    with server:
        client = server.client()
        out = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1,  # type: ignore[arg-type]
                                             extra_body={**ONE_TOKEN, "chat_template_kwargs": kwargs} if kwargs else ONE_TOKEN)
        assert out.choices[0].finish_reason == "length"
        want = reference.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False, **kwargs)
        assert prompts == [want]
        assert out.usage is not None and out.usage.prompt_tokens == len(reference(want)["input_ids"])
        if kwargs:  # the variables reached the template: without them it renders otherwise
            client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1,  # type: ignore[arg-type]
                                           extra_body=ONE_TOKEN)
            assert prompts[1] == reference.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
            assert prompts[1] != prompts[0]


@pytest.mark.parametrize("arch", sorted(GGUF_ARCH))
def test_a_family_gguf_carries_its_chat_template(arch: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # llama.cpp's converter writes the checkpoint's template into tokenizer.chat_template; the loaded
    # tokenizer renders with it as transformers' own GGUF tokenizer does (its class directly:
    # transformers' AutoTokenizer refuses the GGUF architectures it has no config mapping for)
    monkeypatch.setenv("TIDESPEC_CACHE", str(tmp_path / "cache"))
    template, kwargs = FAMILIES[arch]
    hf, _ = tiny_hf_model(arch, torch.float32, seed=9, vocab_size=VOCAB, **CONFIGS[arch])
    path = write_family_gguf(hf, arch, tmp_path / f"tiny-{arch}.gguf", template=template)
    tok = load_model(str(path)).tokenizer
    assert tok.chat_template == template
    reference = transformers.PreTrainedTokenizerFast.from_pretrained(str(tmp_path), gguf_file=path.name)
    assert tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False, **kwargs) == \
        reference.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False, chat_template=template,
                                      **kwargs)


def test_reasoning_effort_reaches_the_template(tmp_path: Path) -> None:
    # OpenAI's reasoning_effort is a request field (the SDK's keyword), passed to the template as vLLM does:
    # gpt-oss's harmony template writes it into its system turn
    directory = _checkpoint("gpt-oss", tmp_path / "gpt-oss")
    reference = transformers.AutoTokenizer.from_pretrained(str(directory))
    server, prompts = _serve(directory)
    with server:
        client = server.client()
        for effort in ("low", None):
            client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1,  # type: ignore[arg-type]
                                           extra_body=ONE_TOKEN, **({"reasoning_effort": effort} if effort else {}))
        assert prompts == [reference.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False,
                                                         reasoning_effort="low"),
                           reference.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)]
        assert "Reasoning: low" in prompts[0] and "Reasoning: medium" in prompts[1]
        with pytest.raises(openai.BadRequestError) as bad:
            client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1,  # type: ignore[arg-type]
                                           extra_body={"reasoning_effort": "extreme"})
        assert bad.value.body["param"] == "reasoning_effort"  # type: ignore[index]


def test_a_templates_refusal_and_a_reserved_variable_are_400s(tmp_path: Path) -> None:
    server, prompts = _serve(_checkpoint("gemma3", tmp_path / "gemma3"))
    with server:
        client = server.client()
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model="tiny", max_tokens=1, messages=[  # type: ignore[arg-type]
                {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
        assert "System role not supported" in str(refused.value) and refused.value.body["param"] == "messages"  # type: ignore[index]
        with pytest.raises(openai.BadRequestError) as reserved:
            client.chat.completions.create(model="tiny", max_tokens=1, messages=MESSAGES,  # type: ignore[arg-type]
                                           extra_body={"chat_template_kwargs": {"add_generation_prompt": False}})
        assert reserved.value.body["param"] == "chat_template_kwargs"  # type: ignore[index]
        assert "add_generation_prompt" in str(reserved.value)
        assert prompts == []  # neither reached the engine
        ok = client.chat.completions.create(model="tiny", max_tokens=1, messages=MESSAGES,  # type: ignore[arg-type]
                                            extra_body=ONE_TOKEN)
        assert ok.choices[0].finish_reason == "length"  # the server answers the next request
