"""Every architecture trio-llm serves, with what each supports: the one list the loader's error for
an unknown architecture names, and docs/models.md is generated from (`models_table`; a test checks
the page is current and that this list and the loaders' own agree)."""

from __future__ import annotations

from dataclasses import dataclass

YES, NO = "yes", "no"


@dataclass(frozen=True)
class Architecture:
    name: str  # as config.json's `architectures` names it
    kind: str
    example: str  # a checkpoint on the hub built on it
    tensor_parallel: str
    pipeline_parallel: str
    lora: str
    quantization: str  # --quantization int8/w8a8/int4 and GGUF files
    compiled: str  # the compiled decode and step graphs on CPU, CUDA graphs on a GPU
    notes: str = ""


_DECODER = dict(tensor_parallel=YES, pipeline_parallel=YES, lora=YES, quantization=YES, compiled=YES)
_MOE = dict(_DECODER, lora="attention only", compiled="yes (eager on CUDA)")
_POOLING = dict(tensor_parallel=NO, pipeline_parallel=NO, lora=NO, quantization=NO, compiled=NO)

ARCHITECTURES: tuple[Architecture, ...] = (
    Architecture("LlamaForCausalLM", "decoder", "meta-llama/Llama-3.2-1B-Instruct", **_DECODER,
                 notes="llama3 rope scaling"),
    Architecture("MistralForCausalLM", "decoder", "mistralai/Mistral-7B-Instruct-v0.3", **_DECODER,
                 notes="sliding-window attention (`sliding_window`)"),
    Architecture("Qwen2ForCausalLM", "decoder", "Qwen/Qwen2.5-0.5B-Instruct", **_DECODER,
                 notes="q/k/v biases; `use_sliding_window` refused"),
    Architecture("Qwen3ForCausalLM", "decoder", "Qwen/Qwen3-0.6B", **_DECODER, notes="q/k norms"),
    Architecture("Gemma3ForCausalLM", "decoder", "google/gemma-3-1b-it", **_DECODER,
                 notes="sliding and global layers, each with its rope base; (1 + w) norms; GeGLU; "
                       "final logit soft-capping"),
    Architecture("Phi3ForCausalLM", "decoder", "microsoft/Phi-3-mini-4k-instruct", **_DECODER,
                 notes="fused qkv and gate_up in the checkpoint; partial rotary; LongRoPE (long factors when the "
                       "context passes the original window, as vLLM); sliding window"),
    Architecture("MixtralForCausalLM", "decoder (MoE)", "mistralai/Mixtral-8x7B-Instruct-v0.1", **_MOE,
                 notes="expert parallelism and EPLB"),
    Architecture("Qwen2MoeForCausalLM", "decoder (MoE)", "Qwen/Qwen1.5-MoE-A2.7B-Chat", **_MOE,
                 notes="shared expert; expert parallelism and EPLB"),
    Architecture("Qwen3MoeForCausalLM", "decoder (MoE)", "Qwen/Qwen3-30B-A3B", **_MOE,
                 notes="expert parallelism and EPLB"),
    Architecture("GptOssForCausalLM", "decoder (MoE)", "openai/gpt-oss-20b", **_MOE,
                 notes="attention sinks; sliding and full layers alternating; YaRN; a biased router and clamped "
                       "SwiGLU experts with biases; expert parallelism and EPLB; MXFP4 checkpoints (as OpenAI "
                       "publishes them) dequantized at load"),
    Architecture("DeepseekV3ForCausalLM", "decoder (MoE)", "deepseek-ai/DeepSeek-V3",
                 **dict(_MOE, lora=NO),
                 notes="multi-head latent attention, the cache holding each token's latent and rotated key part "
                       "(kv_lora_rank + qk_rope_head_dim values a layer); YaRN with its softmax scale; dense first "
                       "layers, shared experts, grouped top-k routing with the correction bias; expert parallelism "
                       "and EPLB; the MTP layers are not loaded; FP8 checkpoints (DeepSeek-V3's own) refused: load a "
                       "bfloat16 copy"),
    Architecture("LlavaForConditionalGeneration", "vision-language", "llava-hf/llava-1.5-7b-hf",
                 tensor_parallel=YES, pipeline_parallel=NO, lora=NO, quantization=NO, compiled=YES,
                 notes="images in chat messages; the encoder cache"),
    Architecture("BertModel", "encoder (pooling)", "sentence-transformers/all-MiniLM-L6-v2", **_POOLING,
                 notes="/v1/embeddings, /score, /rerank"),
    Architecture("BertForSequenceClassification", "encoder (pooling)", "cross-encoder/ms-marco-MiniLM-L6-v2",
                 **_POOLING, notes="/classify, /score, /rerank"),
    *(Architecture(name, "encoder (pooling)", "colbert-ir/colbertv2.0", **_POOLING,
                   notes="late interaction: /pooling token_embed, /score") for name in ("HF_ColBERT", "ColBERTModel")),
)


def served_names() -> list[str]:
    """The architectures served, sorted: what an unknown architecture's error lists."""
    return sorted(a.name for a in ARCHITECTURES)


def models_table() -> str:
    """docs/models.md."""
    lines = ["# Models", "",
             "Generated from `engine/models/registry.py` (`python -m engine.models.registry > docs/models.md`); "
             "a test checks it is current.", "",
             "A model is a directory in Hugging Face's format or a hub id (`trio-llm serve ORG/NAME`). "
             "An architecture not listed here is refused at start-up in one line naming it and this list; "
             "a config field that changes the maths and is not implemented is refused by name.", "",
             "| architecture | kind | e.g. | tensor parallel | pipeline parallel | LoRA | quantization | "
             "compiled | notes |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for a in ARCHITECTURES:
        lines.append(f"| `{a.name}` | {a.kind} | `{a.example}` | {a.tensor_parallel} | {a.pipeline_parallel} | "
                     f"{a.lora} | {a.quantization} | {a.compiled} | {a.notes} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(models_table(), end="")
