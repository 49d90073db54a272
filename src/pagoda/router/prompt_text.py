"""The text a routing policy matches on: the prompt, or the chat messages rendered to one string.

Only its prefixes matter: requests that share a beginning should share a beginning here, and
different conversations should not. It never has to equal what the engine tokenizes.
"""

from __future__ import annotations

from typing import Any


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: keep the text ones, mark the others by type
        pieces = []
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                pieces.append(part["text"])
            elif isinstance(part, dict):
                pieces.append(f"<{part.get('type', 'part')}>")
        return "".join(pieces)
    return ""


def chat_text(messages: Any) -> str:
    if not isinstance(messages, list):
        return ""
    rendered = []
    for message in messages:
        if isinstance(message, dict):
            rendered.append(f"<|{message.get('role', '')}|>{_content_text(message.get('content'))}")
    return "".join(rendered)


def completion_text(prompt: Any) -> str:
    """A string, a list of strings (a batch), token ids, or a batch of token id lists."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return "\n".join(prompt)
        if all(isinstance(t, int) for t in prompt):
            return "".join(f"{t} " for t in prompt)
        if all(isinstance(p, list) for p in prompt):
            return "\n".join(completion_text(p) for p in prompt)
    return ""


def request_text(endpoint: str, payload: dict[str, Any]) -> str:
    if endpoint == "chat":
        return chat_text(payload.get("messages"))
    return completion_text(payload.get("prompt"))
