"""`pl.RuntimeEndpoint`: programs on any pagoda server, over its OpenAI-compatible HTTP API.

Gens are `POST /v1/completions` with the program's text as the prompt (streamed as SSE for
`run(stream=True)`); the chat template is read through `/tokenize` (messages → token ids) and
`/detokenize`; select's scoring uses the `prompt_logprobs` field (vLLM's) with pagoda's
`logprob_start_char` where the server has it (one request a select), else with
`logprob_start_len` and `return_token_ids` (after a `/tokenize` of the prompt): the first select
asks the server which fields it takes, once each, and remembers.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
from collections.abc import Iterator
from typing import Any

import httpx

from pagoda import SamplingParams, http_client
from pagoda.lang.backend.base import Backend, ChoiceScore, GenOutput, choice_scores
from pagoda.lang.choices import TokenLogprob
from pagoda.lang.errors import BackendRequestError
from pagoda.tokenizer.spans import choice_spans

# SamplingParams fields and the /v1/completions fields they travel as (same names but `structured_outputs`).
_SENT_FIELDS = (
    "n",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "max_tokens",
    "min_tokens",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "logprobs",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "logit_bias",
)
_DEFAULTS = SamplingParams()


class RuntimeEndpoint(Backend):
    """`pl.RuntimeEndpoint("http://host:port", api_key=None)`; the key defaults to $PAGODA_API_KEY."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        *,
        model: str | None = None,
        verify: bool | str = True,
        timeout: float | None = 600.0,
    ) -> None:
        super().__init__()
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must be an http(s) URL, got {base_url!r}")
        self.base_url = base_url.rstrip("/")
        api_key = api_key or os.environ.get("PAGODA_API_KEY") or None
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # One client for every thread of run_batch / fork; see http_client for its pool and resends.
        self._client = http_client.client(
            base_url=self.base_url,
            headers=headers,
            verify=verify,
            timeout=httpx.Timeout(timeout, connect=30.0, pool=None),
        )
        self._features: dict[str, bool] = {}
        self._features_lock = threading.Lock()
        cards = self._request("GET", "/v1/models")["data"]
        names = [card["id"] for card in cards]
        if model is not None and model not in names:
            raise ValueError(
                f"{self.name} does not serve model {model!r}; it serves {', '.join(map(repr, names))}"
            )
        self.model = model or names[0]

    @property
    def name(self) -> str:
        return f"pl.RuntimeEndpoint({self.base_url!r})"

    # ---- requests --------------------------------------------------------------------------------
    def generate(self, prompt: str, params: SamplingParams) -> GenOutput:
        data = self._request("POST", "/v1/completions", self._body(prompt, params))
        choice = data["choices"][0]
        token_logprobs, top = self._logprobs([choice.get("logprobs")], params)
        return self._output(choice["text"], choice, data["usage"], token_logprobs, top)

    def generate_stream(self, prompt: str, params: SamplingParams) -> Iterator[str | GenOutput]:
        body = {**self._body(prompt, params), "stream": True, "stream_options": {"include_usage": True}}
        text: list[str] = []
        logprob_chunks: list[Any] = []
        last_choice: dict[str, Any] = {}
        usage = None
        try:
            with self._client.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    response.read()
                    self._check(response)
                for line in response.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    payload = line[len("data: ") :]
                    if payload == "[DONE]":
                        break
                    chunk = json.loads(payload)
                    if "error" in chunk:
                        raise BackendRequestError(f"{self.name}: {chunk['error'].get('message')}")
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                    for choice in chunk.get("choices", []):
                        last_choice = choice
                        if choice.get("logprobs"):
                            logprob_chunks.append(choice["logprobs"])
                        if choice["text"]:
                            text.append(choice["text"])
                            yield choice["text"]
        except httpx.HTTPError as exc:
            raise BackendRequestError(f"{self.name}: {exc!r}") from exc
        if usage is None:
            raise BackendRequestError(f"{self.name}: the stream ended without its usage")
        token_logprobs, top = self._logprobs(logprob_chunks, params)
        yield self._output("".join(text), last_choice, usage, token_logprobs, top)

    def tokenize(self, text: str) -> list[int]:
        return self._request("POST", "/tokenize", {"model": self.model, "prompt": text})["tokens"]

    _prompt_logprobs_need = (
        "prompt logprobs (the prompt_logprobs field of /v1/completions), which this server refuses"
    )

    def supports_prompt_logprobs(self) -> bool:
        return self._feature("prompt_logprobs")

    def prompt_logprobs(self, prompts: list[list[int]], starts: list[int]) -> list[list[float]]:
        self.check_prompt_logprobs()
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": prompts,
            "max_tokens": 0,  # prompt-only: nothing sampled
            "prompt_logprobs": 0,
        }
        if self._feature("logprob_start_len"):
            body["logprob_start_len"] = min(starts)
        data = self._request("POST", "/v1/completions", body)
        choices = sorted(data["choices"], key=lambda c: c["index"])
        result = []
        for choice, prompt, start in zip(choices, prompts, starts, strict=True):
            entries = choice["prompt_logprobs"]
            result.append([_entry_logprob(entries[i], prompt[i]) for i in range(start, len(prompt))])
        usage = data["usage"]
        self._count(
            usage["prompt_tokens"],
            _cached(usage),
            usage["completion_tokens"],
            requests=len(prompts),
        )
        return result

    def score_choices(self, prompt: str, choices: list[str]) -> list[ChoiceScore]:
        """On a server with `logprob_start_char` (pagoda's extension): one prompt-only request with
        the choices as texts, which the server scores from where each choice's tokens differ from
        the prompt's own, computing each row once, and which answers with only the scored spans.
        Otherwise (vLLM's fields): one /tokenize of the prompt, then one such request that scores
        from the prompt's end on and returns each prompt + choice's token ids (vLLM's
        return_token_ids); a choice that re-tokenizes the prompt's end is scored again from its
        true start (exact, one more request), as is a select whose prompt + choice is no longer
        than the prompt (which the server refuses to score from there)."""
        self.check_prompt_logprobs()
        if self._feature("logprob_start_char", 1, prompt="Hello, world: 1 2 3"):
            return self._score_continuations(prompt, choices)
        if not (self._feature("logprob_start_len") and self._feature("return_token_ids", True)):
            return super().score_choices(prompt, choices)
        prompt_ids = self.tokenize(prompt)
        first = len(prompt_ids)
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": [prompt + choice for choice in choices],
            "max_tokens": 0,  # prompt-only: nothing sampled
            "prompt_logprobs": 0,
            "logprob_start_len": first,
            "return_token_ids": True,
        }
        response = self._send("POST", "/v1/completions", body)
        if response.status_code == 400 and _error_param(response) == "logprob_start_len":
            return super().score_choices(prompt, choices)
        data = self._check(response)
        out = sorted(data["choices"], key=lambda c: c["index"])
        full = [c["prompt_token_ids"] for c in out]
        starts = choice_spans(prompt_ids, full)
        if min(starts) < first:  # a choice re-tokenized the prompt's end: score from there
            return choice_scores(prompt_ids, full, starts, self.prompt_logprobs(full, starts))
        usage = data["usage"]
        self._count(usage["prompt_tokens"], _cached(usage), usage["completion_tokens"], requests=len(full))
        logprobs = [
            [_entry_logprob(c["prompt_logprobs"][i], ids[i]) for i in range(start, len(ids))]
            for c, ids, start in zip(out, full, starts, strict=True)
        ]
        return choice_scores(prompt_ids, full, starts, logprobs)

    def _score_continuations(self, prompt: str, choices: list[str]) -> list[ChoiceScore]:
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": [prompt + choice for choice in choices],
            "max_tokens": 0,  # prompt-only: nothing sampled
            "prompt_logprobs": 0,  # each entry is the scored token alone
            "logprob_start_char": len(prompt),
        }
        data = self._request("POST", "/v1/completions", body)
        scores = []
        for c in sorted(data["choices"], key=lambda c: c["index"]):
            ids, lps = [], []
            for entry in c["prompt_logprobs"]:
                if not entry or len(entry) != 1:
                    raise BackendRequestError(f"{self.name}: a scored position without its one entry")
                ((token, value),) = entry.items()
                ids.append(int(token))
                lps.append(float(value["logprob"]))
            start = c["prompt_logprobs_start"]
            # from position 2 on, the tokens before a span are the prompt's own (the server
            # starts it where they differ, or at the last token of a prompt + choice that has none)
            scores.append(ChoiceScore(start, ids, lps, after_prompt=start > 1))
        usage = data["usage"]
        self._count(usage["prompt_tokens"], _cached(usage), usage["completion_tokens"], requests=len(choices))
        return scores

    def flush_cache(self) -> None:
        self._request("POST", "/reset_prefix_cache")

    def shutdown(self) -> None:
        self._client.close()

    # ---- helpers ---------------------------------------------------------------------------------
    def _body(self, prompt: str | list[int], params: SamplingParams) -> dict[str, Any]:
        """The /v1/completions request for `params`; a field this client cannot send is an error,
        never dropped."""
        body: dict[str, Any] = {"model": self.model, "prompt": prompt}
        for f in dataclasses.fields(SamplingParams):
            value = getattr(params, f.name)
            if f.name in _SENT_FIELDS:
                if f.name == "logit_bias" and value is not None:
                    value = {str(k): v for k, v in value.items()}
                body[f.name] = value
            elif f.name == "structured_outputs":
                if value is not None:
                    spec = dataclasses.asdict(value)
                    body["structured_outputs"] = {
                        k: v for k, v in spec.items() if v is not None and v is not False
                    }
            elif not f.name.startswith("_") and value != getattr(_DEFAULTS, f.name):
                raise ValueError(f"{self.name} cannot send SamplingParams.{f.name} to the server")
        return {k: v for k, v in body.items() if v is not None or k == "max_tokens"}

    def _logprobs(
        self, chunks: list[Any], params: SamplingParams
    ) -> tuple[list[TokenLogprob] | None, list[list[TokenLogprob]] | None]:
        if params.logprobs is None:
            return None, None
        token_logprobs: list[TokenLogprob] = []
        top: list[list[TokenLogprob]] = []
        for chunk in chunks:
            if not chunk:
                continue
            for token, lp, best in zip(
                chunk["tokens"], chunk["token_logprobs"], chunk["top_logprobs"], strict=True
            ):
                token_logprobs.append((lp, None, token))
                ranked = sorted((best or {}).items(), key=lambda item: -item[1])[: params.logprobs]
                top.append([(v, None, t) for t, v in ranked])
        return token_logprobs, top

    def _output(
        self,
        text: str,
        choice: dict[str, Any],
        usage: dict[str, Any],
        token_logprobs: list[TokenLogprob] | None,
        top: list[list[TokenLogprob]] | None,
    ) -> GenOutput:
        cached = _cached(usage)
        self._count(usage["prompt_tokens"], cached, usage["completion_tokens"])
        return GenOutput(
            text=text,
            finish_reason=choice.get("finish_reason"),
            stop_reason=choice.get("stop_reason"),
            prompt_tokens=usage["prompt_tokens"],
            cached_tokens=cached,
            completion_tokens=usage["completion_tokens"],
            token_logprobs=token_logprobs,
            top_logprobs=top,
        )

    def _feature(self, field: str, value: Any = 0, *, prompt: str | None = None) -> bool:
        """Whether /v1/completions accepts `field` (asked once with a one-token request, or with
        `prompt`, that sends it as `value`)."""
        with self._features_lock:
            known = self._features.get(field)
        if known is not None:
            return known
        text = self.tokenize("a")[-1:] if prompt is None else prompt
        probe = {"model": self.model, "prompt": text, "max_tokens": 1, field: value}
        if field != "prompt_logprobs":
            probe["prompt_logprobs"] = 0
        response = self._send("POST", "/v1/completions", probe)
        if response.status_code == 200:
            supported = True
        else:
            if _error_param(response) != field:
                self._check(response)
            supported = False
        with self._features_lock:
            self._features[field] = supported
        return supported

    def _send(self, method: str, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
        try:
            return self._client.request(method, path, json=body)
        except httpx.HTTPError as exc:
            raise BackendRequestError(f"{self.name}: {method} {path} failed: {exc!r}") from exc

    def _request(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        return self._check(self._send(method, path, body))

    def _check(self, response: httpx.Response) -> Any:
        status = response.status_code
        if status == 200:
            return response.json()
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = response.text[:500]
        where = f"{self.name} ({response.request.method} {response.request.url.path})"
        if status in (401, 403):
            raise PermissionError(f"{where}: {message}")
        if status in (400, 413, 422):
            raise ValueError(f"{where}: {message}")
        raise BackendRequestError(f"{where}: HTTP {status}: {message}")

    def _render_chat(self, messages: list[dict[str, str]]) -> str:
        body = {"model": self.model, "messages": messages, "add_generation_prompt": False}
        tokens = self._request("POST", "/tokenize", body)["tokens"]
        return self._request("POST", "/detokenize", {"model": self.model, "tokens": tokens})["prompt"]

    def _bos_text(self) -> str:
        def ids(special: bool) -> list[int]:
            body = {"model": self.model, "prompt": "a", "add_special_tokens": special}
            return self._request("POST", "/tokenize", body)["tokens"]

        with_special, plain = ids(True), ids(False)
        n = len(with_special) - len(plain)
        if n <= 0 or with_special[n:] != plain:
            return ""
        return self._request("POST", "/detokenize", {"model": self.model, "tokens": with_special[:n]})[
            "prompt"
        ]


def _error_param(response: httpx.Response) -> str | None:
    """The field an error response names (`error.param`), if any."""
    try:
        return response.json()["error"].get("param")
    except (ValueError, KeyError, AttributeError, TypeError):
        return None


def _cached(usage: dict[str, Any]) -> int:
    details = usage.get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


def _entry_logprob(entry: dict[str, Any] | None, token_id: int) -> float:
    """vLLM's prompt_logprobs entry for one position: {token id: {"logprob": ...}}, keys as JSON strings."""
    if entry is None:
        raise BackendRequestError("the server returned no prompt logprob for a scored position")
    value = entry.get(str(token_id), entry.get(token_id))  # type: ignore[call-overload]
    if value is None:
        raise BackendRequestError(f"the server's prompt logprobs lack the prompt token {token_id}")
    return float(value["logprob"] if isinstance(value, dict) else value)
