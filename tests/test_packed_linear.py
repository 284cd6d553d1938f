"""The LM head's oneDNN-packed weight computes what `F.linear` does."""

from __future__ import annotations

import pytest
import torch

from engine.models.packed_linear import PackedLinear


@pytest.mark.parametrize("rows", [1, 16, 64, 3])
def test_the_packed_linear_equals_f_linear(rows):
    generator = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(1000, 64, generator=generator), torch.randn(1000, generator=generator)
    x = torch.randn(rows, 64, generator=generator)
    packed = PackedLinear.pack(weight)
    if packed is None:
        pytest.fail("oneDNN packing is expected on the CPU build of torch the project pins")
    torch.testing.assert_close(packed(x), torch.nn.functional.linear(x, weight), rtol=1e-5, atol=1e-4)
    with_bias = PackedLinear.pack(weight, bias)
    assert with_bias is not None
    torch.testing.assert_close(with_bias(x), torch.nn.functional.linear(x, weight, bias), rtol=1e-5, atol=1e-4)


def test_only_float32_weights_are_packed():
    assert PackedLinear.pack(torch.randn(8, 4, dtype=torch.bfloat16)) is None
