"""`trio-llm bench async-scheduling`: one server scheduling each step after the one before it has
returned, against the same server with `--async-scheduling` (the next step scheduled while one
runs), like for like: the same model, dtype, flags and client, started and loaded one after the
other, alternating which goes first, medians over the rounds (`bench.side_by_side`)."""

from __future__ import annotations

from bench.side_by_side import alternating_rounds, table, trio_llm_command


async def run(model: str, levels: list[int], num_requests: int, input_len: int, output_len: int, vocab: int,
              dtype: str, extra: list[str], repeats: int = 3, port: int = 8190) -> str:
    sides = [("trio-llm async", [*trio_llm_command(model, port, dtype, extra), "--async-scheduling"], port),
             ("trio-llm sync", trio_llm_command(model, port + 1, dtype, extra), port + 1)]
    ours, theirs = await alternating_rounds(sides, repeats, levels, num_requests, input_len, output_len, vocab)
    head = (f"model={model} dtype={dtype} (both) extra flags {extra or 'none'} (both) input_len={input_len} "
            f"output_len={output_len} rounds={repeats}, alternating which server goes first")
    return head + "\n" + table(ours, theirs, ("async", "sync"))
