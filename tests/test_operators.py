"""Our operators (engine/kernels/operators.py): called eagerly they import no compiler, and
tracing sees them as opaque operators with their fakes' shapes."""

from __future__ import annotations

import subprocess
import sys

import torch

from engine.kernels.operators import operator


@operator("trio_llm::test_scaled_rows")
def scaled_rows(rows: torch.Tensor, factor: float, extra: torch.Tensor | None = None) -> torch.Tensor:
    return rows * factor if extra is None else rows * factor + extra


@scaled_rows.register_fake
def _(rows: torch.Tensor, factor: float, extra: torch.Tensor | None = None) -> torch.Tensor:
    return rows.new_empty(rows.shape)


CALL_IN_A_FRESH_PROCESS = """
import sys, torch
from engine.kernels.q8_0_rows import graph_row_times
rows, weight, scales = torch.ones(1, 32), torch.ones(4, 32, dtype=torch.int8), torch.full((4, 1), 0.5)
print(graph_row_times(rows, weight, scales).tolist(), "torch._dynamo" in sys.modules)
"""


def test_an_operators_first_call_imports_no_compiler():
    # torch.library.custom_op's first call imported torch._dynamo: 1.2 s of every warm start
    out = subprocess.run([sys.executable, "-c", CALL_IN_A_FRESH_PROCESS], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["[[16.0,", "16.0,", "16.0,", "16.0]]", "False"]


def test_an_operator_is_opaque_to_export_with_its_fakes_shape():
    class Model(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return scaled_rows(x, 2.0, x) + 1

    x = torch.arange(6.0).reshape(2, 3)
    exported = torch.export.export(Model(), (x,))
    targets = [node.target for node in exported.graph.nodes if node.op == "call_function"]
    assert torch.ops.trio_llm.test_scaled_rows.default in targets
    assert torch.equal(exported.module()(x), x * 3 + 1)
    assert scaled_rows(x, 0.5).tolist() == [[0.0, 0.5, 1.0], [1.5, 2.0, 2.5]]
