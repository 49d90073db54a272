"""Tiny random models whose tokenizers and chat templates write each family's documented format:
Qwen2.5 / Qwen3 (hermes ``<tool_call>`` JSON, Qwen3 with ``<think>``), Qwen3-Coder (XML calls),
Llama 3.1 (JSON calls, ``ipython`` results), Mistral v0.3 (``[TOOL_CALLS]`` list) and v11
(``[TOOL_CALLS]name[ARGS]{...}``). The templates are written for these tests after the families'
published prompt formats; the special tokens are added to the byte-level test tokenizer."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tokenizers import AddedToken

from pagoda.models.synthetic import build_random_model
from pagoda.tokenizer import load_tokenizer
from tiny_models import TINY_DIMS

# ---- Qwen (ChatML): hermes calls, <think> reasoning -------------------------------------------------
_QWEN_TOOLS = (
    "{%- if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{%- endif %}"
)
_QWEN_HERMES_CALLS = (
    "{%- for tc in m.tool_calls or [] %}{% if m.content or not loop.first %}\n{% endif %}<tool_call>\n"
    '{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}\n'
    "</tool_call>{% endfor %}"
)
_QWEN_XML_CALLS = (
    "{%- for tc in m.tool_calls or [] %}{% if m.content or not loop.first %}\n{% endif %}<tool_call>\n"
    "<function={{ tc.function.name }}>\n"
    "{% for k, v in tc.function.arguments.items() %}<parameter={{ k }}>\n"
    "{{ v if v is string else v | tojson }}\n</parameter>\n{% endfor %}</function>\n</tool_call>"
    "{% endfor %}"
)


def _qwen_template(calls: str, thinking: str) -> str:
    """``thinking``: "" (no reasoning), "hybrid" (Qwen3: the model may open <think>; an empty
    block when enable_thinking is false) or "opened" (the generation prompt opens <think>)."""
    reasoning = (
        "{% if m.reasoning_content %}<think>\n{{ m.reasoning_content.strip('\\n') }}\n</think>\n\n{% endif %}"
        if thinking
        else ""
    )
    prompt = {
        "": "",
        "hybrid": "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}",
        "opened": "<think>\n",
    }[thinking]
    return (
        _QWEN_TOOLS + "\n{%- for m in messages %}"
        "{%- if m.role == 'user' %}<|im_start|>user\n{{ m.content }}<|im_end|>\n"
        "{%- elif m.role == 'assistant' %}<|im_start|>assistant\n"
        + reasoning
        + "{{ m.content or '' }}"
        + calls
        + "<|im_end|>\n"
        "{%- elif m.role == 'tool' %}"
        "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}\n"
        "<tool_response>\n{{ m.content }}\n</tool_response>"
        "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
        "{%- endif %}{%- endfor %}"
        "{%- if add_generation_prompt %}<|im_start|>assistant\n" + prompt + "{% endif %}"
    )


# ---- Llama 3.1: JSON calls, results from the ipython role --------------------------------------------
_LLAMA31 = (
    "{{- bos_token }}"
    "{%- if messages[0].role == 'system' %}{%- set system = messages[0].content %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system = '' %}{%- endif %}"
    "<|start_header_id|>system<|end_header_id|>\n\n{% if tools %}Environment: ipython\n{% endif %}"
    "{{ system }}<|eot_id|>"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' and loop.first and tools %}<|start_header_id|>user<|end_header_id|>\n\n"
    "Given the following functions, please respond with a JSON for a function call with its proper "
    "arguments that best answers the given prompt.\n\n"
    'Respond in the format {"name": function name, "parameters": dictionary of argument name and its '
    "value}. Do not use variables.\n\n{% for t in tools %}{{ t | tojson(indent=4) }}\n\n{% endfor %}"
    "{{ m.content }}<|eot_id|>"
    "{%- elif m.role == 'assistant' and m.tool_calls %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{% for tc in m.tool_calls %}{% if not loop.first %}; {% endif %}"
    '{"name": "{{ tc.function.name }}", "parameters": {{ tc.function.arguments | tojson }}}{% endfor %}'
    "<|eom_id|>"
    "{%- elif m.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>\n\n{{ m.content }}<|eot_id|>"
    "{%- else %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content }}<|eot_id|>"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

# ---- Mistral: [TOOL_CALLS], v0.3 list form and v11 name[ARGS] form ----------------------------------
_MISTRAL_HEAD = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    "{{- bos_token }}"
)
_MISTRAL_V03 = (
    _MISTRAL_HEAD + "{%- for m in messages %}"
    "{%- if m.role == 'user' %}"
    "{%- if tools and loop.index0 == ns.last_user %}[AVAILABLE_TOOLS] {{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "[INST] {{ m.content }}[/INST]"
    "{%- elif m.role == 'system' %}{{ m.content }}\n\n"
    "{%- elif m.role == 'assistant' and m.tool_calls %}[TOOL_CALLS] ["
    "{%- for tc in m.tool_calls %}{% if not loop.first %}, {% endif %}"
    "{%- if tc.id is not string or tc.id | length != 9 %}"
    "{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{% endif %}"
    '{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}, "id": "{{ tc.id }}"}'
    "{%- endfor %}]{{ eos_token }}"
    "{%- elif m.role == 'assistant' %}{{ m.content }}{{ eos_token }}"
    "{%- elif m.role == 'tool' %}"
    '[TOOL_RESULTS] {"content": {{ m.content | tojson }}, "call_id": "{{ m.tool_call_id }}"}[/TOOL_RESULTS]'
    "{%- endif %}{%- endfor %}"
)
_MISTRAL_V11 = (
    _MISTRAL_HEAD + "{%- for m in messages %}"
    "{%- if m.role == 'system' %}[SYSTEM_PROMPT]{{ m.content }}[/SYSTEM_PROMPT]"
    "{%- elif m.role == 'user' %}"
    "{%- if tools and loop.index0 == ns.last_user %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "[INST]{{ m.content }}[/INST]"
    "{%- elif m.role == 'assistant' and m.tool_calls %}"
    "{%- for tc in m.tool_calls %}[TOOL_CALLS]{{ tc.function.name }}[ARGS]{{ tc.function.arguments | tojson }}"
    "{%- endfor %}{{ eos_token }}"
    "{%- elif m.role == 'assistant' %}{{ m.content }}{{ eos_token }}"
    "{%- elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]"
    "{%- endif %}{%- endfor %}"
)


@dataclass(frozen=True)
class Family:
    architecture: str
    template: str
    tokens: tuple[str, ...] = ()  # added as ordinary (non-special) tokens
    special: tuple[str, ...] = ()  # added as special tokens
    eos: tuple[str, ...] = ("<|im_end|>",)
    bos: str | None = None
    extra: dict = field(default_factory=dict)


_QWEN_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>")
_MISTRAL_SPECIAL = (
    "<s>",
    "</s>",
    "[INST]",
    "[/INST]",
    "[TOOL_CALLS]",
    "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]",
)

FAMILIES: dict[str, Family] = {
    "qwen25": Family("Qwen2ForCausalLM", _qwen_template(_QWEN_HERMES_CALLS, ""), _QWEN_TOKENS),
    "qwen3": Family(
        "Qwen3ForCausalLM", _qwen_template(_QWEN_HERMES_CALLS, "hybrid"), _QWEN_TOKENS, extra={"head_dim": 32}
    ),
    "qwen3_thinking": Family(
        "Qwen3ForCausalLM", _qwen_template(_QWEN_HERMES_CALLS, "opened"), _QWEN_TOKENS, extra={"head_dim": 32}
    ),
    "qwen3_coder": Family(
        "Qwen3ForCausalLM", _qwen_template(_QWEN_XML_CALLS, ""), _QWEN_TOKENS, extra={"head_dim": 32}
    ),
    "llama31": Family(
        "LlamaForCausalLM",
        _LLAMA31,
        special=(
            "<|begin_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
            "<|eom_id|>",
            "<|python_tag|>",
        ),
        eos=("<|eot_id|>", "<|eom_id|>"),
        bos="<|begin_of_text|>",
    ),
    "mistral_v03": Family(
        "MistralForCausalLM", _MISTRAL_V03, special=_MISTRAL_SPECIAL, eos=("</s>",), bos="<s>"
    ),
    "mistral_v11": Family(
        "MistralForCausalLM",
        _MISTRAL_V11,
        special=(*_MISTRAL_SPECIAL, "[ARGS]", "[CALL_ID]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]"),
        eos=("</s>",),
        bos="<s>",
    ),
}


def build_family_model(root: Path, name: str, seed: int = 0) -> str:
    """A tiny random checkpoint whose tokenizer and chat template are those of family ``name``."""
    family = FAMILIES[name]
    out = build_random_model(
        root / name,
        family.architecture,
        **TINY_DIMS,
        tie_word_embeddings=False,
        dtype=torch.float32,
        seed=seed,
        initializer_range=0.1,
        max_position_embeddings=4096,
        **family.extra,
    )
    tokenizer = load_tokenizer(out)
    if family.tokens:
        tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in family.tokens])
    if family.special:
        tokenizer.add_tokens(
            [AddedToken(t, special=True, normalized=False) for t in family.special], special_tokens=True
        )
    assert len(tokenizer) <= TINY_DIMS["vocab_size"]
    if family.bos is not None:
        tokenizer.bos_token = family.bos
    tokenizer.eos_token = family.eos[0]
    tokenizer.chat_template = family.template
    tokenizer.save_pretrained(out, save_jinja_files=False)
    eos_ids = [tokenizer.convert_tokens_to_ids(t) for t in family.eos]
    config_path = Path(out) / "generation_config.json"
    config = json.loads(config_path.read_text())
    config["eos_token_id"] = eos_ids
    config_path.write_text(json.dumps(config))
    return out


# Each family's rendering of a call to get_time(tz="utc") and of its result, "22C".
RENDERED = {
    "qwen25": (
        '<tool_call>\n{"name": "get_time", "arguments": {"tz": "utc"}}\n</tool_call>',
        "<tool_response>\n22C\n</tool_response>",
    ),
    "qwen3": (
        '<tool_call>\n{"name": "get_time", "arguments": {"tz": "utc"}}\n</tool_call>',
        "<tool_response>\n22C\n</tool_response>",
    ),
    "qwen3_coder": (
        "<tool_call>\n<function=get_time>\n<parameter=tz>\nutc\n</parameter>\n</function>\n</tool_call>",
        "<tool_response>\n22C\n</tool_response>",
    ),
    "llama31": (
        '{"name": "get_time", "parameters": {"tz": "utc"}}<|eom_id|>',
        "<|start_header_id|>ipython<|end_header_id|>\n\n22C<|eot_id|>",
    ),
    "mistral_v03": (
        '[TOOL_CALLS] [{"name": "get_time", "arguments": {"tz": "utc"}, "id": "',
        '[TOOL_RESULTS] {"content": "22C", "call_id": "',
    ),
    "mistral_v11": ('[TOOL_CALLS]get_time[ARGS]{"tz": "utc"}', "[TOOL_RESULTS]22C[/TOOL_RESULTS]"),
}


def family_models(root: Path) -> Callable[[str], str]:
    """`get(name)`: family `name`'s tiny model folder under `root`, built on its first use."""
    return functools.cache(functools.partial(build_family_model, root))
