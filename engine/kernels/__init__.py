"""Kernels of our own, in C, where torch has none as fast for a shape the engine runs
(docs/decisions.md, "A causal attention kernel of our own"). `native` builds and loads them;
each kernel's module wraps its library for tensors and says when it applies."""
