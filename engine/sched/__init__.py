"""Scheduling: the scheduler, its request queues and the KV block manager.

Plain synchronous Python with no trio and no torch, owned by the engine-core
task, so it is unit-tested without an event loop.
"""
