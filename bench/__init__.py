"""trio-llm's benchmarks: `trio-llm bench ...`.

Nothing in `engine/` or `web/` imports this package (the layering test checks
it): the command reaches the CLI through the `trio_llm.commands` entry point,
and each benchmark measures the public API or passes what it varies as a
parameter.
"""
