"""Rendering: text <-> tokens, chat templates, incremental detokenization with stop strings."""
