"""Expert-parallel load balancing: the placement policy, the expert maps, the load window and the
per-layer transfer plan. Plain torch on small CPU tensors; no event loop, no device."""
