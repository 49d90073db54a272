"""Settings shared by the lang tests' backends."""

from __future__ import annotations

# A longer context than the shared tiny models', for 512-token shared prompts with branches after them.
LANG_MODEL_CONTEXT = 2048
# The same engine settings in-process and in the server, so greedy results must agree.
ENGINE_FLAGS = {"dtype": "float32", "num_kv_blocks": 1024}
