"""Chat templates without a server: each family's template renders a multi-turn conversation with
tool calls and results in its documented format, the server's settings are chosen from it, template
keywords and tools are checked, `LLM.chat(tools=...)` renders them offline, and the chat flags of
`pagoda serve` reach the server and its replicas."""

from __future__ import annotations

import json

import pytest
from chat_families import FAMILIES, RENDERED, family_models

from pagoda.entrypoints import serve_cli
from pagoda.entrypoints.cli import build_parser, main
from pagoda.entrypoints.llm import LLM
from pagoda.entrypoints.openai.chat_settings import ChatSettings
from pagoda.sampling_params import SamplingParams
from pagoda.tokenizer import load_tokenizer
from pagoda.tokenizer.chat import apply_chat_template, normalize_messages

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The time in a time zone",
            "parameters": {
                "type": "object",
                "properties": {"tz": {"enum": ["utc", "cet"]}},
                "required": ["tz"],
            },
        },
    }
]
HISTORY = [
    {"role": "user", "content": "What time is it?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "a1b2c3d4e",
                "type": "function",
                "function": {"name": "get_time", "arguments": '{"tz": "utc"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "a1b2c3d4e", "content": "22C"},
]
# (tool call parser, reasoning parser) each family's template is read as.
EXPECTED = {
    "qwen25": ("hermes", None),
    "qwen3": ("hermes", "qwen3"),
    "qwen3_thinking": ("hermes", "qwen3"),
    "qwen3_coder": ("qwen3_xml", None),
    "llama31": ("llama3_json", None),
    "mistral_v03": ("mistral", None),
    "mistral_v11": ("mistral", None),
}


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory: pytest.TempPathFactory):
    return family_models(tmp_path_factory.mktemp("templates"))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_templates_render_calls_and_results(family_dir, family: str) -> None:
    tokenizer = load_tokenizer(family_dir(family))
    settings = ChatSettings.create(tokenizer)
    parser, reasoning = EXPECTED[family]
    assert settings.tool_format is not None and settings.tool_format.name == parser
    assert settings.reasoning_parser == reasoning and settings.renders_tools
    messages = HISTORY
    if settings.tool_format.prepare_messages is not None:
        messages = settings.tool_format.prepare_messages(messages)
    ids = apply_chat_template(tokenizer, messages, tools=TOOLS)
    text = tokenizer.decode(ids, skip_special_tokens=False)
    assert '"get_time"' in text and "The time in a time zone" in text  # the tools are rendered
    if family in RENDERED:
        call, result = RENDERED[family]
        assert call in text and result in text and text.index(call) < text.index(result)
    # Mistral's markers are special tokens: a parser needs them shown, and the rest hidden.
    hidden = settings.hidden_specials(True, tools=True, reasoning=False)
    if family.startswith(("mistral", "llama")):
        assert hidden is not None and "[TOOL_CALLS]" not in hidden and "<|python_tag|>" not in hidden
        assert ("</s>" if family.startswith("mistral") else "<|eot_id|>") in hidden
    else:
        assert hidden is None


def test_template_keywords_are_checked(family_dir) -> None:
    tokenizer = load_tokenizer(family_dir("qwen3"))
    plain = apply_chat_template(tokenizer, HISTORY[:1])
    off = apply_chat_template(tokenizer, HISTORY[:1], enable_thinking=False)
    assert tokenizer.decode(off).endswith("<think>\n\n</think>\n\n") and off[: len(plain)] == plain
    with pytest.raises(ValueError, match="does not use 'thinking_budget'"):
        apply_chat_template(tokenizer, HISTORY[:1], thinking_budget=3)
    with pytest.raises(ValueError, match="does not render documents"):
        apply_chat_template(tokenizer, HISTORY[:1], documents=[{"text": "x"}])
    with pytest.raises(ValueError, match="continue_final_message needs an assistant message last"):
        apply_chat_template(tokenizer, HISTORY[:1], continue_final_message=True)
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        ChatSettings.create(tokenizer, reasoning_parser="granite")
    with pytest.raises(ValueError, match="does not use 'nope'"):
        ChatSettings.create(tokenizer, default_kwargs={"nope": 1})
    assert (
        ChatSettings.create(tokenizer, tool_call_parser="none", reasoning_parser="none").tool_format is None
    )


def test_documents_reach_the_template(family_dir) -> None:
    tokenizer = load_tokenizer(family_dir("qwen25"))
    tokenizer.chat_template = (
        "{% for d in documents %}[doc {{ d.title }}: {{ d.text }}]{% endfor %}"
        "{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    ids = apply_chat_template(tokenizer, HISTORY[:1], documents=[{"title": "T", "text": "body"}])
    assert tokenizer.decode(ids) == "[doc T: body]What time is it?"


def test_normalize_messages() -> None:
    out = normalize_messages([{"role": "assistant", "content": "x", "reasoning": "r", **HISTORY[1]}])
    assert out[0]["reasoning_content"] == "r" and "reasoning" not in out[0]
    assert out[0]["tool_calls"][0]["function"]["arguments"] == {"tz": "utc"}
    assert HISTORY[1]["tool_calls"][0]["function"]["arguments"] == '{"tz": "utc"}'  # left alone
    bad = {**HISTORY[1], "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}
    with pytest.raises(
        ValueError, match=r"messages\[0\]\.tool_calls\[0\]\.function\.arguments must be a JSON object"
    ):
        normalize_messages([bad])


def test_llm_chat_renders_tools(family_dir) -> None:
    llm = LLM(family_dir("qwen25"), dtype="float32", num_kv_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=4)
    (out,) = llm.chat(HISTORY, params, tools=TOOLS)
    prompt = llm.tokenizer.decode(out.prompt_token_ids)
    call, result = RENDERED["qwen25"]
    assert '"name": "get_time"' in prompt and call in prompt and result in prompt
    (cont,) = llm.chat(
        [*HISTORY, {"role": "assistant", "content": "It is"}],
        params,
        tools=TOOLS,
        add_generation_prompt=False,
        continue_final_message=True,
    )
    assert llm.tokenizer.decode(cont.prompt_token_ids).endswith("<|im_start|>assistant\nIt is")
    with pytest.raises(ValueError, match=r"tools\[0\]\.function\.parameters"):
        llm.chat(
            HISTORY,
            params,
            tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}],
        )
    with pytest.raises(ValueError, match="tools must be a list"):
        llm.chat(HISTORY, params, tools={"type": "function"})


def test_serve_chat_flags_reach_the_server_and_replicas(monkeypatch: pytest.MonkeyPatch, family_dir) -> None:
    model = family_dir("qwen3")
    kwargs = {"enable_thinking": False}
    argv = [
        "serve",
        model,
        "--tool-call-parser",
        "hermes",
        "--reasoning-parser",
        "deepseek_r1",
        "--enable-auto-tool-choice",
        "--default-chat-template-kwargs",
        json.dumps(kwargs),
    ]
    args = build_parser().parse_args(argv)
    assert (args.tool_call_parser, args.reasoning_parser, args.enable_auto_tool_choice) == (
        "hermes",
        "deepseek_r1",
        True,
    )
    assert args.default_chat_template_kwargs == kwargs
    flags = serve_cli._replica_flags(serve_cli._engine_args(args, model), serve_cli._server_args(args))
    reparsed = build_parser().parse_args(["serve", model, *flags])
    assert reparsed.default_chat_template_kwargs == kwargs and reparsed.tool_call_parser == "hermes"
    assert reparsed.reasoning_parser == "deepseek_r1" and reparsed.enable_auto_tool_choice
    seen = {}
    import pagoda.entrypoints.openai.app as app

    monkeypatch.setattr(
        app, "run_server", lambda engine_args, config: seen.setdefault("config", config) and 0
    )
    assert main(argv) == 0
    config = seen["config"]
    assert (config.tool_call_parser, config.reasoning_parser) == ("hermes", "deepseek_r1")
    assert config.default_chat_template_kwargs == kwargs


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--default-chat-template-kwargs", "{oops"], "not valid JSON"),
        (["--default-chat-template-kwargs", "[1]"], "must be a JSON object"),
        (["--tool-call-parser", "granite"], "invalid choice"),
    ],
)
def test_bad_chat_flags(
    capsys: pytest.CaptureFixture[str], family_dir, flags: list[str], message: str
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", family_dir("qwen25"), *flags])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
