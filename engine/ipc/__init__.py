"""The transport every process of the engine uses: framed messages over a socket (`wire`), the trio
stream that carries them with a short poll before it sleeps (`fast_socket`, `polling`), and starting
and stopping a child process that owns one end of a socket (`process`).

It knows nothing of what the messages mean: the engine process's messages are in
`engine.core.engine_messages`, the worker processes' in `engine.worker.worker_messages`.
"""
