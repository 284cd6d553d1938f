"""GraphPlan: which graphs a decoder rank runs, decided once from the config, the rank and the model."""

from __future__ import annotations

from engine.config import CompilationConfig, EngineConfig
from engine.worker.graph_plan import DecodeRunner, GraphPlan


def plan(parallel_ranks: int = 1, moe: bool = False, lora: bool = False, on_cuda: bool = False,
         latent_attention: bool = False, **options) -> GraphPlan:
    config = EngineConfig(model="m", **{"enforce_eager": False, **options})
    return GraphPlan.choose(config, parallel_ranks=parallel_ranks, moe=moe, lora=lora, on_cuda=on_cuda,
                            latent_attention=latent_attention)


def test_a_cpu_rank_compiles_its_decodes_and_its_prompts_unless_told_otherwise():
    assert plan() == GraphPlan(DecodeRunner.COMPILED, step_graph=True)
    assert plan(moe=True) == GraphPlan(DecodeRunner.COMPILED, step_graph=False)  # experts break one graph
    # DeepSeek's latent attention decodes compiled; the step graph's attention op does not take it
    assert plan(latent_attention=True) == GraphPlan(DecodeRunner.COMPILED, step_graph=False)
    assert not plan(compilation_config=CompilationConfig(compile_prompts=False)).step_graph
    assert plan(lora=True).decode is DecodeRunner.COMPILED  # the LoRA delta compiles into the graph
    assert plan(enforce_eager=True) == GraphPlan(DecodeRunner.EAGER, step_graph=False)


def test_a_cuda_rank_captures_graphs_and_says_why_when_it_cannot():
    # Prompt steps on torch.compile's step graph (their token counts vary: not captured), unless
    # told not to compile them, not to compile at all, or the attention is DeepSeek's latent one.
    assert plan(on_cuda=True) == GraphPlan(DecodeRunner.CAPTURED, step_graph=True)
    assert not plan(on_cuda=True, compilation_config=CompilationConfig(compile_prompts=False)).step_graph
    assert plan(on_cuda=True, compilation_config=CompilationConfig(mode=0)) == GraphPlan(DecodeRunner.CAPTURED,
                                                                                          step_graph=False)
    assert not plan(on_cuda=True, latent_attention=True).step_graph
    assert plan(on_cuda=True, lora=True).why_eager == "CUDA graphs are not captured for LoRA adapters"
    assert "an MoE model's experts" in (plan(on_cuda=True, moe=True).why_eager or "")


def test_parallel_ranks_and_moving_experts_run_eagerly_and_only_graphs_pad_batches():
    assert plan(parallel_ranks=2).decode is DecodeRunner.EAGER
    assert "expert load balancing" in (plan(enable_eplb=True).why_eager or "")
    assert plan().pads_batches and plan(on_cuda=True).pads_batches and not plan(parallel_ranks=2).pads_batches
