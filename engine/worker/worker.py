"""The Worker: the same class runs in-process (in a worker thread) or in a child process.

Every method is blocking and called by one executor at a time, in order;
arguments and results are plain picklable data.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch

from engine.config import EngineConfig
from engine.cpu_binding import CpuLayout, bound_to
from engine.ec.storage import save_rows
from engine.eplb.plan import LayerPlan
from engine.errors import ModelLoadError
from engine.kernels import causal_attention as causal_attention_kernel
from engine.kernels import paged_decode, q8_0_rows
from engine.lora.adapter import LoRAAdapter, LoRAError, read_adapter
from engine.lora.serving import LoRAServing
from engine.model_info import ModelInfo, PoolerConfig
from engine.models.attention import SequenceChunk, build_metadata
from engine.models.bert import BertEncoder, is_encoder_config
from engine.models.decoder import DecoderForCausalLM, KVCache
from engine.models.hf_config import is_llava_config, parse_decoder_config, read_config_json
from engine.models.layers import Linear
from engine.models.loader import load_decoder, load_encoder, load_llava
from engine.models.moe import expert_layout_for
from engine.models.packed_linear import slower_than_float32
from engine.models.parallel import PipelineStage, TensorParallel, init_distributed
from engine.models.pooler import read_pooler_config
from engine.models.vision import LlavaVision
from engine.sched.output import ModelRunnerOutput, SchedulerOutput, StepSink
from engine.worker.compile_child import CompileJob
from engine.worker.cpu_allocator import keep_freed_memory_in_heap, lazily_zeroed
from engine.worker.cuda_graphs import CallThrough, CapturedDecode, CudaGraphCapture, max_table_blocks
from engine.worker.decode_graphs import DecodeGraphs, use_compile_cache
from engine.worker.encoder_runner import EncoderRunner
from engine.worker.expert_mover import ExpertMover
from engine.worker.gpu_memory import GIB, CudaMemory, MemoryProbe, kv_cache_budget, measure
from engine.worker.grammar_masks import GrammarMasks
from engine.worker.graph_plan import DecodeRunner, GraphPlan
from engine.worker.model_runner import ModelRunner, RankRole, RunnerFeatures, RunnerGraphs
from engine.worker.q8_0_tiles import lay_out_q8_0_tiles, tile_budget_bytes
from engine.worker.step_graph import StepGraph
from engine.worker.thread_tuner import ThreadTuner

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeferredGraphs:
    """Graphs built over the worker's KV cache but not compiled: a child process compiles them."""

    decode: DecodeGraphs
    step: StepGraph | None
    num_blocks: int


def all_saved(graphs: DecodeGraphs, step_graph: StepGraph | None) -> bool:
    """Whether a start would load these graphs rather than compile them."""
    return graphs.saved_on_disk() and (step_graph is None or step_graph.saved_on_disk())


def thread_tuner_for(layout: CpuLayout | None, torch_threads: int) -> ThreadTuner:
    """The tuner of a worker's steps: from one thread to one per compute CPU and per borrowable
    server CPU, starting with all of them: nothing is served before the first step, so the
    server's CPU is idle, and the first prompts (a step of seconds on the 0.5B shape) run on every
    core; a busy CPU shows in the first probe. With nothing bound, up to torch's own count (its
    default, or OMP_NUM_THREADS), starting there."""
    if layout is None:
        return ThreadTuner(torch_threads)
    return ThreadTuner(layout.most_threads)


class Worker:
    """One rank's model, KV cache and runner. With `world_size` > 1 it joins the
    tensor-parallel process group at construction (blocking until every rank has)."""

    def __init__(self, config: EngineConfig, rank: int = 0, world_size: int = 1,
                 distributed_init_method: str | None = None) -> None:
        self.config = config
        self.rank = rank
        # Global rank = pipeline stage * ranks per stage + tensor-parallel rank (engine/models/parallel.py).
        stages = config.pipeline_parallel_size
        per_stage = world_size // stages
        self.tp = TensorParallel(rank % per_stage, per_stage)
        self.stage = PipelineStage(rank // per_stage, stages, per_stage, config.pipeline_layer_partition)
        self.device = torch.device(config.device)
        if self.device.type == "cpu":
            keep_freed_memory_in_heap()
        # --cpu-threads-bind: one intra-op thread per compute CPU; calls below run bound to them.
        self.layout = config.cpu_layout
        self.compute_cpus = self.layout.compute if self.layout is not None else None
        if self.compute_cpus is not None:
            torch.set_num_threads(len(self.compute_cpus))
        # Each step's thread count, measured (EngineConfig.tunes_cpu_threads says where).
        self.thread_tuner: ThreadTuner | None = None
        if config.tunes_cpu_threads:
            self.thread_tuner = thread_tuner_for(self.layout, torch.get_num_threads())
        if world_size > 1:
            if distributed_init_method is None:
                raise ValueError("tensor parallelism needs a distributed_init_method")
            self.tp = init_distributed(self.tp, distributed_init_method, self.device, self.stage)
        self.model: DecoderForCausalLM | BertEncoder | None = None
        self.runner: ModelRunner | EncoderRunner | None = None
        self.pooler = PoolerConfig()
        self.mover: ExpertMover | None = None  # an MoE model's rebalancing hands
        self.vision: LlavaVision | None = None  # a vision-language model's tower and projector
        self.lora: LoRAServing | None = None  # the LoRA adapters served (--enable-lora)
        self.deferred_graphs: DeferredGraphs | None = None  # compiling in a child (compile_in_background)
        self.zeroed_caches = True  # False in a compile child: its caches are never read before written

    def load_model(self) -> ModelInfo:
        with bound_to(self.compute_cpus):
            return self._load_model()

    @contextlib.contextmanager
    def _every_lent_cpu(self) -> Iterator[None]:
        """While the weights are read, converted and quantized: the compute CPUs and, where the
        layout lends it, the server's CPU too, one intra-op thread each. Nothing is served yet,
        so the loop's CPU is idle (the 0.5B Q8_0 file: docs/benchmarks.md)."""
        layout = self.layout
        if layout is None or not layout.borrow:
            yield
            return
        threads = torch.get_num_threads()
        cpus = layout.cpus_for(layout.most_threads)
        torch.set_num_threads(len(cpus))
        try:
            with bound_to(cpus):
                yield
        finally:
            torch.set_num_threads(threads)

    def _load_model(self) -> ModelInfo:
        raw = read_config_json(self.config.model)
        if self.stage.size > 1:
            check_pipeline_parallel(self.config, raw)
        if self.config.quantization and (is_encoder_config(raw) or is_llava_config(raw)):
            kind = "encoder (BERT)" if is_encoder_config(raw) else "vision-language"
            raise ModelLoadError(f"--quantization {self.config.quantization}: not implemented for {kind} models")
        if is_encoder_config(raw):
            return self._load_encoder(raw)
        if is_llava_config(raw):
            return self._load_llava()
        self.pooler = read_pooler_config(self.config.model, raw, "last", self.config.pooler_config)
        max_positions = self.config.max_model_len
        cfg = parse_decoder_config(raw)
        layout = expert_layout_for(cfg.moe, self.config, self.rank)
        with self._every_lent_cpu():
            self.model = load_decoder(self.config.model, self.config.dtype, self.config.device, max_positions,
                                      self.tp, layout, self.stage, self.config.quantization)
        if layout is not None:
            self.mover = ExpertMover(self.model.moe_layers, layout, self.device)
        if self.config.q8_0_activations != "auto":
            self._choose_q8_0_activations(self.config.q8_0_activations)
        elif self.device.type == "cpu" and self._lay_out_q8_0_tiles():
            self._lend_a_helper()
        if self._starting_compute_threads() == 1:
            self.model.hold_tied_table_as_rows()
        causal_attention_kernel.available()  # built now (once per machine), not at the first prompt
        paged_decode.available()  # nor at the first decode
        self._warn_if_reduced_precision_is_slower()
        self._load_lora_adapters()
        info = self._decoder_info()
        if layout is None:
            return info
        return replace(info, num_moe_layers=len(self.model.moe_layers), num_logical_experts=layout.num_logical,
                       num_physical_experts=layout.num_physical, num_expert_ranks=layout.ep_size)

    def _lay_out_q8_0_tiles(self) -> bool:
        """Auto's two int8 levels read tiles laid out once (`Linear.pack_q8_0_tiles`), a second copy
        of a layer's weight: every layer of at most 512 features gets them, wider ones while all
        the copies stay within `tile_budget_bytes` (a quarter of the machine's memory), the rest
        keeping float32 rows. Whether any layer has them."""
        assert isinstance(self.model, DecoderForCausalLM)
        auto = [m for m in self.model.modules() if isinstance(m, Linear) and m.q8_0_activations == "auto"]
        budget = tile_budget_bytes()
        tiled, held, left_out = lay_out_q8_0_tiles(auto, budget)
        if tiled and self.rank == 0:
            logger.info("q8_0 tiles for the two int8 levels laid out for %d of %d layers: %.0f MB, a second copy of "
                        "their weights%s", tiled, len(auto), held / 1e6,
                        f"; {left_out} wider layers keep float32 rows (the copies' budget: a quarter of this "
                        f"machine's memory, {budget / 1e9:.1f} GB)" if left_out else "")
        return tiled > 0

    def _lend_a_helper(self) -> None:
        """Where the layout lends the HTTP server's CPU and the thread tuner is on: steps on one
        compute thread (what the tuner keeps while the HTTP server is busy there) share their large
        q8_0 products, the LM head's above all, with a helper thread on that CPU that takes chunks
        only when it gets to run (engine/kernels/lent_cpu.h; served, 1.00-1.06x at 16 streams and
        1.06-1.12x at one, docs/benchmarks.md)."""
        if self.layout is None or not self.layout.borrow or not self.config.tunes_cpu_threads:
            return
        cpus = self.layout.borrow
        if not q8_0_rows.lend_cpus(cpus):
            return
        share = q8_0_rows.lent_share_address()
        attention = share is not None and paged_decode.share_with(share)
        if self.rank == 0:
            logger.info("one-thread steps share large q8_0 products (the LM head)%s with a helper thread on CPUs %s",
                        " and decode attention" if attention else "", ",".join(map(str, cpus)))

    def _choose_q8_0_activations(self, activations: str) -> None:
        """--q8-0-activations float32 or int8: how every q8_0 layer multiplies a batch of decodes'
        rows (the layers' default is auto). int8 is llama.cpp's arithmetic, fast with AVX-512 VNNI
        (said at start-up where the CPU has none); on a device other than the CPU, or on a model
        with no q8_0 layer, it fails start-up naming why."""
        assert isinstance(self.model, DecoderForCausalLM)
        if activations == "int8" and (self.device.type != "cpu" or not q8_0_rows.available()):
            raise ModelLoadError(f"--q8-0-activations int8 runs on our CPU kernel; on {self.device.type} (or without "
                                 "a C compiler) leave it at auto or float32")
        if activations == "int8" and not q8_0_rows.int8_fast() and self.rank == 0:
            logger.warning("--q8-0-activations int8: this CPU has no AVX-512 VNNI, so the int8 products run one at "
                           "a time, slower than float32 rows")
        chosen = [m.multiply_q8_0_activations_as(activations) for m in self.model.modules() if isinstance(m, Linear)]
        if activations == "int8" and not any(chosen):
            raise ModelLoadError("--q8-0-activations int8: the model has no q8_0 layers (a GGUF file's Q8_0 tensors, "
                                 "or --quantization q8_0)")

    def _starting_compute_threads(self) -> int:
        """The intra-op threads steps start on: the tuner's first count (it moves within 1 and its
        `max_threads`, one more for a borrowable CPU), or torch's count."""
        return self.thread_tuner.threads if self.thread_tuner is not None else torch.get_num_threads()

    def _load_lora_adapters(self) -> None:
        """Read and check every configured adapter (a bad one fails start-up, naming it)."""
        if not self.config.enable_lora:
            return
        assert isinstance(self.model, DecoderForCausalLM)
        if self.model.config.mla is not None:  # adapters name q_proj/k_proj/v_proj, which MLA does not have
            raise ModelLoadError(f"--enable-lora: not implemented for {self.model.config.architecture} (its latent "
                                 "attention has no q/k/v projections for adapters to target)")
        dtype = self.model.dtype

        def read(name: str, path: str) -> LoRAAdapter:
            return read_adapter(name, path, self.config.max_lora_rank, dtype)

        any_rank = self.config.max_lora_rank if self.config.lora_slots_fit_any else None
        try:
            self.lora = LoRAServing(self.model, read, {m.name: m.path for m in self.config.lora_modules},
                                    self.config.max_loras, self.config.lora_cpu_capacity, any_module_rank=any_rank)
        except LoRAError as exc:
            raise ModelLoadError(str(exc)) from None

    def add_lora(self, name: str, path: str) -> None:
        """Serve LoRA adapter `name` from directory `path` (replacing one of that name), read and
        checked here: a bad one raises `LoRAError` and changes nothing."""
        if self.lora is None:
            raise LoRAError("this engine serves no LoRA adapters (start it with --enable-lora)")
        self.lora.add(name, path)

    def remove_lora(self, name: str) -> None:
        """Stop serving LoRA adapter `name` (the engine asks once no request uses it)."""
        if self.lora is not None:
            self.lora.remove(name)

    def _warn_if_reduced_precision_is_slower(self) -> None:
        """bfloat16 / float16 on a CPU that runs them slower than float32 (measured: a few ms) is
        said at start-up, once, by the first rank."""
        assert isinstance(self.model, DecoderForCausalLM)
        if self.device.type == "cpu" and self.rank == 0 and self.model.dtype != torch.float32:
            slower = slower_than_float32(self.model.dtype)
            if slower is not None:
                logger.warning(slower)

    def _load_llava(self) -> ModelInfo:
        self.model, self.vision, cfg = load_llava(self.config.model, self.config.dtype, self.config.device,
                                                  self.config.max_model_len, self.tp)
        return replace(self._decoder_info(), image_token_id=cfg.image_token_index,
                       image_rows=self.vision.rows_per_image, architecture="LlavaForConditionalGeneration")

    def _decoder_info(self) -> ModelInfo:
        assert isinstance(self.model, DecoderForCausalLM)
        cfg = self.model.config
        element_size = torch.empty((), dtype=self.kv_cache_dtype).element_size()
        # This rank's share: the cache budget applies per rank, as each holds its own heads (and,
        # under pipeline parallelism, its own layers).
        per_block = self.model.num_kv_caches * element_size * sum(
            math.prod(shape) for shape in self.model.kv_cache_shapes(self.config.block_size))
        quantized = [m for m in self.model.modules() if isinstance(m, Linear) and m.qweight is not None]
        quantization = "+".join(sorted({str(m.qmethod) for m in quantized})) or None  # a GGUF file may mix
        return ModelInfo(cfg.vocab_size, cfg.hidden_size, cfg.max_position_embeddings, cfg.eos_token_ids,
                         str(self.model.dtype).removeprefix("torch."), per_block, "decoder", cfg.architecture,
                         self.pooler, quantization=quantization, weight_bytes=self.model.weight_bytes,
                         q8_0_activations=q8_0_activations_in_effect(quantized),
                         kv_group_windows=self.model.kv_layout.group_windows,
                         kv_cache_dtype=str(self.kv_cache_dtype).removeprefix("torch."))

    def _load_encoder(self, raw: dict[str, Any]) -> ModelInfo:
        if self.tp.size > 1:
            raise ModelLoadError("tensor parallelism is not supported for encoder (BERT) models")
        self.model = load_encoder(self.config.model, self.config.dtype, self.config.device)
        self.pooler = replace(read_pooler_config(self.config.model, raw, "cls", self.config.pooler_config),
                              late_interaction=self.model.config.late_interaction)
        cfg = self.model.config
        # Encoders keep no KV cache; blocks are only the scheduler's accounting of a step's tokens.
        nominal_block = self.config.block_size * cfg.hidden_size * 4
        num_labels = cfg.num_labels if self.model.classifier is not None else 0
        return replace(ModelInfo(cfg.vocab_size, cfg.hidden_size, cfg.max_position_embeddings, (),
                         str(self.model.dtype).removeprefix("torch."), nominal_block, "encoder", cfg.architecture,
                         self.pooler, num_labels), labels=cfg.labels if num_labels else ())

    def initialize_kv_cache(self, num_blocks: int) -> None:
        assert self.model is not None, "load_model() first"
        if isinstance(self.model, BertEncoder):
            self.runner = EncoderRunner(self.model, self.pooler, self.device)
            return
        if isinstance(self.runner, ModelRunner) and self.runner.num_blocks == num_blocks:
            self.runner.requests.clear()  # a new engine run over the same cache: forget old requests
            return
        cfg = self.model.config
        plan = self._graph_plan()
        if plan.why_eager is not None:
            logger.info("decode steps run eagerly: %s", plan.why_eager)
        caches = self._kv_caches((num_blocks + plan.pads_batches) * self.config.block_size)
        graphs, step_graph = self._graphs(plan, caches, num_blocks)
        features = RunnerFeatures(self.pooler, self.config.enable_eplb, self.vision, self._ec_saver(),
                                  GrammarMasks(self.config.tokenizer_path, cfg.vocab_size), self.lora)
        self.runner = ModelRunner(self.model, caches, self.config.block_size, self.device, self.config.seed,
                                  num_blocks=num_blocks, role=RankRole(self.is_driver, self.stage, self.tp.rank),
                                  graphs=RunnerGraphs(graphs, step_graph), features=features)
        if isinstance(graphs, DecodeGraphs) and self._defers_compiling(graphs, step_graph):
            # Steps run eagerly until `adopt_compiled_graphs` (engine/core/background_compile.py).
            self.runner.decode_graphs, self.runner.step_graph = None, None
            self.deferred_graphs = DeferredGraphs(graphs, step_graph, num_blocks)
            logger.info("serving on the eager model while a child process compiles the graphs "
                        "(--no-compile-in-background waits for them)")
            return
        with bound_to(self.compute_cpus), torch.inference_mode():
            if isinstance(graphs, CapturedDecode):
                graphs.capture_all()
            elif graphs is not None:
                graphs.compile_all()
            if step_graph is not None:
                step_graph.compile()

    def _defers_compiling(self, graphs: DecodeGraphs, step_graph: StepGraph | None) -> bool:
        """Whether the graphs compile in a child process while steps run eagerly: asked for
        (`compile_in_background`), one worker (ranks would have to switch together), a dense model
        (an MoE model's graphs go through torch.compile, which a child cannot save for us), and
        something left to compile."""
        return (self.config.compile_in_background and self.tp.size * self.stage.size == 1
                and not graphs.model.moe_layers
                and not all_saved(graphs, step_graph))

    def background_compile_job(self) -> CompileJob | None:
        """What a child process runs to compile and save this worker's deferred graphs (None:
        nothing deferred). It computes on the CPUs the event loop keeps, which a step leaves
        idle, rather than on the ones steps run on."""
        if self.deferred_graphs is None:
            return None
        layout = self.layout
        on = None if layout is None else CpuLayout(layout.server, layout.server)
        config = replace(self.config, compile_in_background=False, cpu_layout=on, adaptive_cpu_threads=False)
        return CompileJob(config, self.deferred_graphs.num_blocks)

    def adopt_compiled_graphs(self) -> bool:
        """Load the deferred graphs that a child saved, and run steps on them from the next step
        on; False (logged) when they are not there (the child failed): steps stay eager."""
        deferred, self.deferred_graphs = self.deferred_graphs, None
        if deferred is None or not isinstance(self.runner, ModelRunner):
            return False
        graphs, step_graph = deferred.decode, deferred.step
        if not all_saved(graphs, step_graph):
            logger.warning("the compiled graphs were not saved; steps stay on the eager model")
            return False
        with bound_to(self.compute_cpus), torch.inference_mode():
            graphs.compile_all()  # loads them: a few seconds at most
            if step_graph is not None:
                step_graph.compile()
        self.runner.decode_graphs, self.runner.step_graph = graphs, step_graph
        return True

    def kv_cache_bytes_for(self, utilization: float) -> int:
        """The KV cache's bytes on this rank's GPU when the engine may use `utilization` of it
        (--gpu-memory-utilization), from a profile run (engine/worker/gpu_memory.py)."""
        assert isinstance(self.model, DecoderForCausalLM), "load_model() first (a decoder)"
        decode = self._profile_decode if self._graph_plan().decode is DecodeRunner.CAPTURED else None
        with bound_to(self.compute_cpus), torch.inference_mode():
            profile = measure(self._memory_probe(), self._profile_step, decode)
        budget = kv_cache_budget(profile, utilization)
        logger.info("GPU memory: %s; the KV cache gets %.2f GiB (--gpu-memory-utilization %s)",
                    profile.describe(), budget / GIB, utilization)
        return budget

    def _memory_probe(self) -> MemoryProbe:
        return CudaMemory(self.device)

    def _profile_caches(self) -> list[KVCache]:
        """One block per layer: every profiled token writes there (the profile's outputs are dropped)."""
        assert isinstance(self.model, DecoderForCausalLM)
        return self._kv_caches(self.config.block_size)

    @property
    def kv_cache_dtype(self) -> torch.dtype:
        """The KV cache's dtype (--kv-cache-dtype): the model's, or a 16-bit one under it. Keys and
        values are rounded to it as they are written and computed with in the model's dtype."""
        assert isinstance(self.model, DecoderForCausalLM), "load_model() first (a decoder)"
        choice = self.config.kv_cache_dtype
        return self.model.dtype if choice == "auto" else getattr(torch, choice)

    def _kv_caches(self, slots: int) -> list[KVCache]:
        """The key and value cache pairs of `slots` token slots, zeroed: one per layer, or one per
        position in a KV cache group (engine/kv_groups.py)."""
        assert isinstance(self.model, DecoderForCausalLM)
        keys, values = self.model.kv_cache_shapes(slots)
        dtype = self.kv_cache_dtype
        if torch.device(self.device).type == "cpu" and self.zeroed_caches:  # zero pages, written on first use
            return [(lazily_zeroed(keys, dtype), lazily_zeroed(values, dtype)) for _ in range(self.model.num_kv_caches)]
        allocate = torch.zeros if self.zeroed_caches else torch.empty  # empty: no memory until written
        return [(allocate(keys, dtype=dtype, device=self.device), allocate(values, dtype=dtype, device=self.device))
                for _ in range(self.model.num_kv_caches)]

    def _profile_step(self) -> None:
        """The largest step the scheduler sends: one fresh prompt of the whole token budget, and the
        logits of as many rows as sequences may sample."""
        model = self.model
        assert isinstance(model, DecoderForCausalLM) and model.rope is not None
        tokens, size = min(self.config.token_budget, model.rope.max_positions), self.config.block_size
        chunk = SequenceChunk(0, tokens, [0] * -(-tokens // size))
        meta = build_metadata([chunk], size, self.device, model.dtype)
        hidden = torch.zeros(tokens, model.config.hidden_size, dtype=model.dtype, device=self.device)
        out = model(hidden, torch.arange(tokens, device=self.device), self._profile_caches(), meta)
        if model.lm_head is not None:
            model.compute_logits(out[:self.config.max_num_seqs])

    def _profile_decode(self) -> None:
        """The captured decode graph that gathers the most, run once uncaptured."""
        model = self.model
        assert isinstance(model, DecoderForCausalLM) and model.rope is not None
        graphs = CapturedDecode(model, self._profile_caches(), self.config.block_size, 0,
                                self.config.decode_batch_sizes,
                                max_table_blocks(model.rope.max_positions, self.config.block_size), CallThrough())
        graphs.run_largest()

    def _graph_plan(self) -> GraphPlan:
        assert isinstance(self.model, DecoderForCausalLM)
        return GraphPlan.choose(self.config, parallel_ranks=self.tp.size * self.stage.size,
                                moe=bool(self.model.moe_layers), lora=self.lora is not None,
                                on_cuda=self._captures_graphs(), latent_attention=self.model.config.mla is not None)

    def _captures_graphs(self) -> bool:
        """Whether this rank's graphs would be captured CUDA graphs (on CUDA) rather than compiled."""
        return self.device.type == "cuda"

    def _graphs(self, plan: GraphPlan, caches: list[KVCache],
                num_blocks: int) -> tuple[DecodeGraphs | CapturedDecode | None, StepGraph | None]:
        """The decode graphs and the step graph `plan` asks for, over `caches` (not yet compiled)."""
        assert isinstance(self.model, DecoderForCausalLM)
        block_size = self.config.block_size
        if plan.decode is DecodeRunner.CAPTURED:  # prompt steps: torch.compile's graph, not captured
            step_graph = StepGraph(self.model, caches, block_size, num_blocks, jit=True) if plan.step_graph else None
            return self._captured_decode(caches, num_blocks), step_graph
        if plan.decode is DecodeRunner.EAGER:
            return None, None
        cache_dir = use_compile_cache(self.config.compilation_config.cache_dir)
        graphs = DecodeGraphs(self.model, caches, block_size, num_blocks, self.config.decode_batch_sizes, cache_dir)
        step_graph = StepGraph(self.model, caches, block_size, num_blocks, cache_dir) if plan.step_graph else None
        return graphs, step_graph

    def _captured_decode(self, caches: list[KVCache], num_blocks: int) -> CapturedDecode:
        """On CUDA, decode steps replay captured CUDA graphs (engine/worker/cuda_graphs.py) rather
        than an AOTInductor package, which is built and checked for CPU only."""
        assert isinstance(self.model, DecoderForCausalLM)
        max_len = self.model.rope.max_positions if self.model.rope is not None else self.config.block_size
        return CapturedDecode(self.model, caches, self.config.block_size, num_blocks, self.config.decode_batch_sizes,
                              max_table_blocks(max_len, self.config.block_size), CudaGraphCapture(),
                              compile_model=self.config.compilation_config.compiles)

    @property
    def is_driver(self) -> bool:
        """This rank samples and replies: the first tensor-parallel rank of the last stage."""
        return self.stage.is_last and self.tp.rank == 0

    def execute_model(self, sched_out: SchedulerOutput, on_step: StepSink | None = None) -> ModelRunnerOutput:
        """The step, its sample read back to the host (this thread waits for the device).
        `on_step`: a decode burst's tokens step by step (`ModelRunner.execute`)."""
        output = self.start_model(sched_out, on_step)
        output.resolve()
        return output

    def start_model(self, sched_out: SchedulerOutput, on_step: StepSink | None = None) -> ModelRunnerOutput:
        """The step, its sample possibly still on its way to the host: `output.pending`, whose
        `stream` a `DeviceEvent` is recorded on before `output.resolve()` (the step queue's way)."""
        assert self.runner is not None, "initialize_kv_cache() first"
        tuner = self.thread_tuner
        threads = tuner.next_threads() if tuner is not None else None
        with bound_to(self._cpus_for(threads)):  # a syscall or two per step
            if sched_out.eplb_commit is not None:
                self.eplb_commit_layer(sched_out.eplb_commit)
            if tuner is None or threads is None:
                return self.runner.execute(sched_out, on_step)
            return self._execute_tuned(sched_out, tuner, threads, on_step)

    def _cpus_for(self, threads: int | None) -> tuple[int, ...] | None:
        """The CPUs a step on `threads` runs on (None: unbound). A borrowed CPU joins only for
        the steps that run a thread on it. (OpenMP's threads keep the CPUs of the thread that
        started them, so the extra one, started on a step that borrows, may run there.)"""
        if self.layout is None or threads is None:
            return self.compute_cpus
        return self.layout.cpus_for(threads)

    def _execute_tuned(self, sched_out: SchedulerOutput, tuner: ThreadTuner, threads: int,
                       on_step: StepSink | None) -> ModelRunnerOutput:
        """The step on `threads`, the count the tuner picked, timed for it."""
        assert self.runner is not None
        if torch.get_num_threads() != threads:  # per thread: a pool may hand us another one
            torch.set_num_threads(threads)
        started = time.perf_counter()
        output = self.runner.execute(sched_out, on_step)
        before, probe = tuner.threads, tuner.last_probe
        tuner.record(threads, (sched_out.total_num_tokens, output.steps_run), time.perf_counter() - started,
                     steps=output.steps_run)
        if tuner.last_probe is not probe:
            logger.debug("probed %d compute threads: steps took %.2fx the time of %d", tuner.last_probe[0],
                         tuner.last_probe[1] or 0.0, before)
        if tuner.threads != before:
            logger.info("compute threads %d -> %d: steps took %.2fx the time with %d", before, tuner.threads,
                        tuner.last_probe[1] or 0.0, tuner.threads)
        return output

    def eplb_stage_layer(self, plan: LayerPlan, first: int = 0, count: int | None = None) -> int:
        """Stage one MoE layer's moving experts, or the part `plan.moves[first:first + count]` of them
        (see `ExpertMover.stage`); how many of this rank's slots the part fills."""
        assert self.mover is not None, "an MoE model"
        return self.mover.stage(plan, first, count)

    def eplb_commit_layer(self, plan: LayerPlan) -> None:
        """Adopt a staged layer: its weights into the live slots, its maps for routing."""
        assert self.mover is not None, "an MoE model"
        self.mover.commit(plan)

    def _ec_saver(self) -> Callable[[str, torch.Tensor], bool] | None:
        """An EC producer stores every encoder output it computes in the shared directory."""
        ec = self.config.ec_transfer_config
        if ec is None or not ec.is_producer or self.vision is None:
            return None
        return partial(save_rows, ec.storage_path)

    def ping(self) -> str:
        return "pong"


def q8_0_activations_in_effect(layers: list[Linear]) -> str | None:
    """How `layers`' q8_0 ones multiply a batch of decodes, for the start-up lines: their
    `--q8-0-activations`, except that "auto" reads "float32" where two int8 levels never apply
    (no AVX-512 VNNI, or no tiles and every q8_0 layer wider than 512 features); None without q8_0
    layers."""
    kinds = {m.q8_0_activations: m for m in layers if m.q8_0_activations is not None}
    if not kinds:
        return None
    if "int8" in kinds or "float32" in kinds:
        return "int8" if "int8" in kinds else "float32"
    short = any(m.qtiles is not None or (m.qweight is not None and m.qweight.shape[1] <= q8_0_rows.TWO_LEVELS_UP_TO_K)
                for m in layers if m.q8_0_activations == "auto")
    return "auto" if short and q8_0_rows.int8_fast() else "float32"


def check_pipeline_parallel(config: EngineConfig, raw: dict[str, Any]) -> None:
    """`ModelLoadError` for what pipeline stages do not run (yet): encoders, vision models, LoRA
    and moving experts."""
    refused = [(is_encoder_config(raw), "encoder (BERT) models"), (is_llava_config(raw), "vision-language models"),
               (config.enable_lora, "LoRA adapters"), (config.enable_eplb, "expert load balancing"),
               (config.enable_expert_parallel, "expert parallelism")]
    for applies, what in refused:
        if applies:
            raise ModelLoadError(f"pipeline parallelism does not support {what} yet")
