"""`@operator("trio_llm::name")`: a Python function made a torch operator, the way
`torch.library.custom_op` makes one (its schema inferred from the annotations, a fake for tracing
registered with `.register_fake`), but through `torch.library.Library` itself.

Why not `custom_op`: it wraps the implementation in `torch._disable_dynamo`, which imports
torch._dynamo at the operator's first call: 1.2-1.3 s on this 2-core machine, paid at every warm
start when the step graph's agreement check first runs `trio_llm::step_attention` (the package
calls it through torch's proxy executor), or by the first prompt. The operator defined here calls
its function with nothing around it: no import, and half the dispatch cost (12 against 24 us a
call, measured one-off). Tracing is unchanged: dynamo and export see an opaque operator and its
fake, as before. Nothing here is differentiable (inference only: no autograd formula is
registered, as `custom_op` registered none).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

NAMESPACE = "trio_llm"
# Kept alive: the definitions live as long as it. (torch.library is untyped.)
_LIBRARY = torch.library.Library(NAMESPACE, "FRAGMENT")  # type: ignore[no-untyped-call]


class Operator:
    """A function defined as the operator `trio_llm::<name>`; calling this calls the operator."""

    def __init__(self, name: str, function: Callable[..., Any]) -> None:
        self.name = name
        _LIBRARY.define(name + torch.library.infer_schema(function, mutates_args=()))  # type: ignore[no-untyped-call]
        _LIBRARY.impl(name, function, "CompositeExplicitAutograd")  # type: ignore[no-untyped-call]
        self.overload: torch._ops.OpOverload = getattr(getattr(torch.ops, NAMESPACE), name).default
        functools.update_wrapper(self, function)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.overload(*args, **kwargs)

    def register_fake(self, fake: Callable[..., Any]) -> Callable[..., Any]:
        """The operator's shapes for tracing (meta tensors in, meta tensors out)."""
        torch.library.register_fake(f"{NAMESPACE}::{self.name}", fake, lib=_LIBRARY)
        return fake


def operator(qualified_name: str) -> Callable[[Callable[..., Any]], Operator]:
    """Decorator: `@operator("trio_llm::step_attention")` over a function with annotated arguments."""
    namespace, _, name = qualified_name.partition("::")
    if namespace != NAMESPACE or not name:
        raise ValueError(f"our operators are named {NAMESPACE}::<name>, not {qualified_name!r}")
    return lambda function: Operator(name, function)
