"""oneDNN-packed weights for the one matmul that reads a large weight at every step: the LM head.

A decode step at batch 1 multiplies one row by the whole [vocab, hidden] LM head. torch's
`F.linear` does that with a GEMV over the weight as stored, far from what the memory allows;
oneDNN's linear over a weight reordered once into its blocked layout (what inductor's mkldnn
passes use, `torch.ops.mkldnn._reorder_linear_weight` and `_linear_pointwise`) reads it at
nearly memory speed. Measured on this machine (2 threads, float32, [32000, 256]): 2.1 ms against
0.21 ms at 1 row, 4.0 against 0.75 ms at 16, 8.1 against 2.6 ms at 64 (`trio-llm bench forward`
and docs/benchmarks.md). The packed copy is extra memory (the embedding table keeps its own
rows when the two are tied): vocab x hidden x 4 bytes.

Only float32 on a CPU with oneDNN is packed; anything else keeps `F.linear` (`pack` returns None).
"""

from __future__ import annotations

import torch

# The batch oneDNN lays the weight out for; decode batches go up to 64 (the compiled graph's
# default), and a layout for 64 served 1 row faster than one for 1 did.
BATCH_HINT = 64


class PackedLinear:
    """`x @ weight.T + bias` with the weight in oneDNN's layout. The weight must not change after
    packing (the LM head does not: it is loaded once)."""

    def __init__(self, packed: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.packed = packed
        self.bias = bias

    @classmethod
    def pack(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> PackedLinear | None:
        """The packed linear, or None where packing does not apply (not float32 on a CPU with
        oneDNN, or this torch build lacks the ops)."""
        if weight.device.type != "cpu" or weight.dtype != torch.float32 or not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
            return None
        try:
            with torch.no_grad():
                packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), BATCH_HINT)
        except (AttributeError, RuntimeError):
            return None
        return cls(packed, None if bias is None else bias.detach())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")
