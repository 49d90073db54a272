"""The engine: the core loop (schedule → execute → update), input and output processing, the
synchronous LLMEngine and the thread-backed AsyncLLM."""
