"""The names `--tool-call-parser` and `--reasoning-parser` take, in a module of their own: the command
line reads them before it starts the engine process, without importing the chat machinery."""

TOOL_PARSERS = ("hermes", "llama3_json", "openai")
REASONING_PARSERS = ("qwen3", "deepseek_r1", "openai_gptoss")
