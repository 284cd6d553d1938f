"""The Worker: the same class runs in-process (in a worker thread) or in a child process.

Every method is blocking and called by one executor at a time, in order;
arguments and results are plain picklable data.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.models.decoder import DecoderForCausalLM
from engine.models.loader import load_decoder
from engine.models.parallel import TensorParallel, init_distributed
from engine.sched.output import ModelRunnerOutput, SchedulerOutput
from engine.worker.cpu_allocator import keep_freed_memory_in_heap
from engine.worker.model_runner import ModelRunner


@dataclass(frozen=True)
class ModelInfo:
    vocab_size: int
    hidden_size: int
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    dtype: str
    kv_bytes_per_block: int


class Worker:
    """One rank's model, KV cache and runner. With `world_size` > 1 it joins the
    tensor-parallel process group at construction (blocking until every rank has)."""

    def __init__(self, config: EngineConfig, rank: int = 0, world_size: int = 1,
                 distributed_init_method: str | None = None) -> None:
        self.config = config
        self.rank = rank
        self.tp = TensorParallel(rank, world_size)
        self.device = torch.device(config.device)
        if self.device.type == "cpu":
            keep_freed_memory_in_heap()
        if world_size > 1:
            if distributed_init_method is None:
                raise ValueError("tensor parallelism needs a distributed_init_method")
            init_distributed(self.tp, distributed_init_method, self.device)
        self.model: DecoderForCausalLM | None = None
        self.runner: ModelRunner | None = None

    def load_model(self) -> ModelInfo:
        max_positions = self.config.max_model_len
        self.model = load_decoder(self.config.model, self.config.dtype, self.config.device, max_positions, self.tp)
        cfg = self.model.config
        element_size = torch.empty((), dtype=self.model.dtype).element_size()
        # This rank's share: the cache budget applies per rank, as each holds its own heads.
        kv_heads = self.model.num_local_kv_heads
        per_block = 2 * cfg.num_layers * self.config.block_size * kv_heads * cfg.head_dim * element_size
        return ModelInfo(cfg.vocab_size, cfg.hidden_size, cfg.max_position_embeddings, cfg.eos_token_ids,
                         str(self.model.dtype).removeprefix("torch."), per_block)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        assert self.model is not None, "load_model() first"
        if self.runner is not None and self.runner.num_blocks == num_blocks:
            self.runner.requests.clear()  # a new engine run over the same cache: forget old requests
            return
        cfg = self.model.config
        shape = (num_blocks * self.config.block_size, self.model.num_local_kv_heads, cfg.head_dim)
        caches = [(torch.zeros(shape, dtype=self.model.dtype, device=self.device),
                   torch.zeros(shape, dtype=self.model.dtype, device=self.device))
                  for _ in range(cfg.num_layers)]
        self.runner = ModelRunner(self.model, caches, self.config.block_size, self.device, self.config.seed,
                                  is_driver=self.rank == 0)

    def execute_model(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        assert self.runner is not None, "initialize_kv_cache() first"
        return self.runner.execute(sched_out)

    def ping(self) -> str:
        return "pong"

    def model_summary(self) -> dict:
        """What this rank holds (for operators and tests): its rank and share of the model."""
        assert self.model is not None, "load_model() first"
        return {"rank": self.rank, "world_size": self.tp.size, "local_kv_heads": self.model.num_local_kv_heads,
                "num_parameters": sum(p.numel() for p in self.model.parameters())}
