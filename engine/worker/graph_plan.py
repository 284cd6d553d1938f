"""Which graphs a decoder rank's steps run on: decided once, at start-up, from the config, the
rank and the model, with the reason when a rank runs eagerly that a user might expect compiled."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from engine.config import EngineConfig


class DecodeRunner(Enum):
    EAGER = "eager"
    COMPILED = "compiled"  # one inductor graph with a dynamic batch (CPU; engine/worker/decode_graphs.py)
    CAPTURED = "captured"  # CUDA graphs, one per batch size and table width (engine/worker/cuda_graphs.py)


@dataclass(frozen=True)
class GraphPlan:
    decode: DecodeRunner
    step_graph: bool  # the other steps (prompt chunks) on the compiled step graph (engine/worker/step_graph.py)
    why_eager: str | None = None  # said at start-up: why a rank that could have graphs has none

    @property
    def pads_batches(self) -> bool:
        """Whether decode graphs pad batches with rows that write to a scratch KV block (past the
        scheduler's blocks), which the KV cache must then hold."""
        return self.decode is not DecodeRunner.EAGER

    @classmethod
    def choose(cls, config: EngineConfig, *, parallel_ranks: int, moe: bool, lora: bool, on_cuda: bool,
               latent_attention: bool = False) -> GraphPlan:
        """The plan of one decoder rank. `parallel_ranks`: the tensor-parallel ranks times the
        pipeline stages (their collectives run eagerly); `moe`: the model has experts (which break
        one exported graph); `lora`: adapters are served; `on_cuda`: the rank runs on a CUDA device
        (captured graphs there, never the CPU's AOTInductor package); `latent_attention`: DeepSeek's
        MLA, which the step graph's opaque attention op does not take (its prompts run eagerly)."""
        if config.eager:
            return cls(DecodeRunner.EAGER, step_graph=False)
        if not config.compilation_config.compiles and not on_cuda:
            return cls(DecodeRunner.EAGER, False, "compilation_config mode 0 compiles nothing")
        if parallel_ranks > 1:
            return cls(DecodeRunner.EAGER, False, "tensor- and pipeline-parallel ranks run eagerly")
        if config.enable_eplb:
            return cls(DecodeRunner.EAGER, False, "expert load balancing moves weights between steps")
        if on_cuda:
            if lora or moe:  # their rows pick adapters or experts at run time, which a captured graph cannot
                what = "LoRA adapters" if lora else "an MoE model's experts"
                return cls(DecodeRunner.EAGER, False, f"CUDA graphs are not captured for {what}")
            compiling = config.compilation_config
            return cls(DecodeRunner.CAPTURED, step_graph=compiling.compile_prompts and compiling.compiles
                       and not latent_attention)
        prompts = config.compilation_config.compile_prompts and not (moe or latent_attention)
        return cls(DecodeRunner.COMPILED, step_graph=prompts)
