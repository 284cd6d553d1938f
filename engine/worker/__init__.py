"""The worker: owns the model and the KV cache tensors, runs one step at a time.

Everything here is blocking torch code; the executor decides where it runs
(a worker thread today, a child process later).
"""
