"""The offline API: `LLM(model).generate(prompts, params)`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from tqdm.auto import tqdm

from pagoda.config import EngineArgs
from pagoda.engine.input_processor import Prompt
from pagoda.engine.llm_engine import LLMEngine
from pagoda.kernels import build as cpu_kernels
from pagoda.outputs import RequestOutput
from pagoda.sampling_params import SamplingParams
from pagoda.tokenizer.chat import apply_chat_template

Messages = list[dict]


class LLM:
    """An engine for offline batch inference. Keyword arguments are those of `EngineArgs`."""

    def __init__(self, model: str, **kwargs) -> None:
        engine_args = EngineArgs(model=model, **kwargs)
        # Chooses (and on first use builds) the CPU kernel variant and logs it, or the reason for
        # the PyTorch fallback; a bad PAGODA_CPU_ISA raises ValueError here.
        cpu_kernels.available()
        self.engine = LLMEngine(engine_args)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | None = None,
        cache_salt: str | None = None,
    ) -> list[RequestOutput]:
        """Generate completions; outputs come back in the order of `prompts`. A prompt is a
        string, a list of token ids, or vLLM's dict forms `{"prompt": text}` and
        `{"prompt_token_ids": [ids]}`."""
        if isinstance(prompts, str | Mapping) or (
            isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        params = _broadcast(sampling_params, len(prompts))
        return self._run(prompts, params, use_tqdm, cache_salt)

    def chat(
        self,
        messages: Messages | Sequence[Messages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | None = None,
        cache_salt: str | None = None,
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        **chat_template_kwargs,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them (lists of {role, content}).

        ``tools`` are OpenAI function tools (``{"type": "function", "function": {"name",
        "description", "parameters"}}``) for the chat template to render; history messages may
        carry assistant ``tool_calls`` (``arguments`` as JSON text or objects) and ``tool``
        results. The replies are the raw text (the server parses calls out of it)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        if tools is not None:
            chat_template_kwargs["tools"] = _checked_tools(tools)
        if continue_final_message:
            chat_template_kwargs["continue_final_message"] = True
        prompts = [
            apply_chat_template(
                self.engine.tokenizer,
                conv,
                add_generation_prompt=add_generation_prompt,
                **chat_template_kwargs,
            )
            for conv in conversations
        ]
        return self._run(prompts, _broadcast(sampling_params, len(prompts)), use_tqdm, cache_salt)

    def reset_prefix_cache(self) -> int:
        return self.engine.reset_prefix_cache()

    def shutdown(self) -> None:
        """Stop the tensor-parallel worker ranks (with tensor_parallel_size > 1) and leave their
        process group, so that another parallel engine can start in this process. Idempotent."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def _run(self, prompts, params, use_tqdm, cache_salt) -> list[RequestOutput]:
        engine = self.engine
        ids = []
        try:
            for prompt, p in zip(prompts, params, strict=True):
                ids.append(engine.add_request(None, prompt, p, cache_salt=cache_salt))
        except ValueError:
            engine.abort_request(ids)
            raise
        results: dict[str, RequestOutput] = {}
        show = len(ids) > 1 if use_tqdm is None else use_tqdm
        with tqdm(total=len(ids), desc="Generating", disable=not show) as bar:
            while len(results) < len(ids):
                for out in engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        bar.update(1)
        return [results[i] for i in ids]


def _checked_tools(tools: object) -> list[dict]:
    """OpenAI function tools, each checked as the server checks them (ValueError naming the bad one)."""
    from pydantic import ValidationError

    from pagoda.entrypoints.openai.protocol import ChatTool

    if not isinstance(tools, list):
        raise ValueError(f"tools must be a list of function tools, got {type(tools).__name__}")
    checked = []
    for i, tool in enumerate(tools):
        try:
            checked.append(ChatTool.model_validate(tool).to_dict())
        except ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(str(p) for p in err["loc"])
            raise ValueError(f"tools[{i}]{'.' + where if where else ''}: {err['msg']}") from None
    return checked


def _broadcast(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} sampling params for {n} prompts")
    return params
