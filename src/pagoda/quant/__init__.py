"""GGML / GGUF weight formats: block layouts, (de)quantization, weight formats of linear layers, GGUF reading."""
