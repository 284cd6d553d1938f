"""`LeanBurst`: the later steps of a decode burst whose requests' tokens come from their logits
alone (no logprobs, penalties, biases or masks), run on the compiled decode graph with inputs
written in place.

Why a path of its own: on CPU a small model's decode is a few hundred microseconds of kernels, and
the general step (`ModelRunner._execute_one`: the batch's states, metadata built from lists, the
embedding, the sampler's penalty, bias and mask passes, the sample's copy and bookkeeping) adds
~200 us a step on the small Llama's Q8_0 file, more than its body's kernels. Much of that is not
the Python itself: each eager torch call after the graphs runs cold (the embedding's lookup: 16.6
us the first time in a step, 4.1 us when repeated at once). Here a step is the two graph calls
(body, LM head), a few numpy writes and the sampler's choice (`choose`: for greedy rows a numpy
argmax): measured on that file, 394-413 us a step against 595-619 us on the general path
(docs/benchmarks.md, "Greedy bursts on the graphs alone").

What stays the same: the graph (the one `DecodeGraphs.run` calls, on the same rows, slots, lengths
and block tables: the tables are fixed for the burst, whose room the scheduler took up front), the
LM head, and the choice (`choose`, with each request's generator, or the runner's, drawn in the
same order), so the tokens are the general path's.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy
import torch

from engine.models.decoder import DecoderForCausalLM
from engine.worker.decode_graphs import DecodeGraphs
from engine.worker.sampler import SamplingRow, argmax_rows, choose


class LeanBurst:
    """Decodes of `len(tokens)` sequences, one position on each `step`. `tokens`: each one's last
    sampled token; `positions`: where that token goes; `tables`: each one's block table, covering
    every position the burst will reach; `rows`: each one's sampling, `generator` the draws of the
    rows without one of their own."""

    def __init__(self, graphs: DecodeGraphs, model: DecoderForCausalLM, tokens: Sequence[int],
                 positions: Sequence[int], tables: Sequence[Sequence[int]], block_size: int,
                 rows: list[SamplingRow], generator: torch.Generator) -> None:
        self._graphs = graphs
        self._model = model
        self._count = len(tokens)
        padded = max(self._count, graphs.min_rows)
        self._block_size = block_size
        self._tables = [list(t) for t in tables]
        self._rows = rows
        self._generator = generator
        self._all_greedy = all(row.params.greedy for row in rows)
        self.meta = graphs.metadata(padded, [0] * self._count, [1] * self._count, tables)
        self.positions = torch.zeros(padded, dtype=torch.long)
        self.hidden = torch.zeros(padded, model.config.hidden_size, dtype=model.dtype)
        # numpy views of the inputs, written in place each step (a few small writes, no torch call)
        self._slots, self._lengths = self.meta.slot_mapping.numpy(), self.meta.seq_lens.numpy()
        self._positions = self.positions.numpy()
        table = _embedding_table(model)  # float32 rows only: numpy has no bfloat16
        self._embeddings = None if table is None else (table, self.hidden.numpy())
        self._tokens = list(tokens)
        self._next = list(positions)  # where each sequence's token goes this step

    def step(self) -> list[int]:
        """One decode of every sequence: its token written at its position, the next one chosen
        from its logits and returned, one per sequence."""
        count = self._count
        self._write_inputs()
        hidden = self._graphs.run_prepared(self.hidden, self.positions, self.meta)
        logits = self._graphs.compute_logits(hidden if hidden.shape[0] == count else hidden[:count])
        chosen = argmax_rows(logits) if self._all_greedy else choose(logits, self._rows, self._generator)
        self._tokens = chosen.tolist()
        self._next = [position + 1 for position in self._next]
        return self._tokens

    def _write_inputs(self) -> None:
        count, size, positions = self._count, self._block_size, self._next
        self._positions[:count] = positions
        self._lengths[:count] = [position + 1 for position in positions]
        self._slots[:count] = [table[position // size] * size + position % size
                               for table, position in zip(self._tables, positions, strict=True)]
        if self._embeddings is None:
            self.hidden[:count] = self._model.embed(torch.tensor(self._tokens, dtype=torch.long))
            return
        table, hidden = self._embeddings
        if count == 1:
            hidden[0] = table[self._tokens[0]]
        else:
            hidden[:count] = table[self._tokens]


def _embedding_table(model: DecoderForCausalLM) -> numpy.ndarray | None:
    """The token embeddings as a numpy view, where a row of it is the token's embedding as is
    (float32, no scale, one rank's whole table): rows are then copied without a torch call.
    None: `model.embed` computes them."""
    embed = model.embed_tokens
    if (embed is None or model.config.embed_scale is not None or embed.tp.size != 1
            or embed.weight.dtype != torch.float32 or model.dtype != torch.float32):
        return None
    return embed.weight.detach().numpy()
