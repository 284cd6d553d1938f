"""Loading a model from an HF-format directory: config.json + safetensors (single or sharded)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from engine.config import QUANTIZATIONS
from engine.errors import ModelLoadError
from engine.models.bert import BertEncoder, EncoderConfig
from engine.models.compressed_tensors import dequantized, read_scheme
from engine.models.decoder import DecoderForCausalLM
from engine.models.gguf_file import block_formats, gguf_tensors, is_gguf
from engine.models.hf_config import (
    DecoderConfig,
    LlavaConfig,
    parse_decoder_config,
    parse_llava_config,
    read_config_json,
    read_json_file,
)
from engine.models.moe import ExpertLayout
from engine.models.mxfp4 import mxfp4_dequantized
from engine.models.parallel import PipelineStage, TensorParallel
from engine.models.vision import LlavaVision, VisionConfig
from engine.models.weights import CheckpointTensor

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(requested: str, checkpoint_dtype: str, device: str = "cpu") -> torch.dtype:
    """The dtype a model runs in. `auto`: the checkpoint's, except that a float32 checkpoint runs in
    bfloat16 on a CUDA device, as vLLM's `auto` does there (a GPU's tensor cores and bandwidth
    want 16 bits); on the CPU float32 stays float32."""
    name = (checkpoint_dtype if requested == "auto" else requested).removeprefix("torch.")
    if requested == "auto" and name == "float32" and torch.device(device).type == "cuda":
        name = "bfloat16"
    if name not in DTYPES:
        raise ModelLoadError(f"unsupported dtype {name!r}; supported: {sorted(DTYPES)}")
    return DTYPES[name]


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json_file(index).get("weight_map", {})
        files = sorted({model_dir / f for f in weight_map.values()})
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise ModelLoadError(f"{index} names shard files that are missing: {absent}")
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise ModelLoadError(f"{model_dir} has no model.safetensors or model.safetensors.index.json")


def iterate_weights(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint. A progress bar (on stderr) appears if loading takes over a
    second; small models load without one."""
    with tqdm(total=sum(f.stat().st_size for f in files), unit="B", unit_scale=True, delay=1.0,
              desc="Loading weights", leave=False) as progress:
        for path in files:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 -- a safetensors handle has keys() but is not iterable
                    tensor = f.get_tensor(name)
                    progress.update(tensor.numel() * tensor.element_size())
                    yield name, tensor


def load_decoder(model_dir: str | Path, dtype: str = "auto", device: str = "cpu",
                 max_positions: int | None = None, tp: TensorParallel = TensorParallel(),
                 experts: ExpertLayout | None = None, stage: PipelineStage = PipelineStage(),
                 quantization: str | None = None) -> DecoderForCausalLM:
    """Build and load the model (this rank's shard of it, under tensor or expert parallelism;
    `experts` places an MoE model's expert slots; `stage`, its pipeline stage's layers only), from
    an HF directory or a GGUF file, with its linear layers quantized as `quantization` says
    (`resolve_quantization`). Blocking (file I/O, copies): run it off the loop."""
    model_dir = Path(model_dir)
    raw = read_config_json(model_dir)
    cfg: DecoderConfig = parse_decoder_config(raw)
    mxfp4 = (raw.get("quantization_config") or {}).get("quant_method") == "mxfp4"
    if mxfp4 and cfg.family != "gpt_oss":
        raise ModelLoadError(f"quantization_config 'mxfp4': not implemented for {cfg.architecture} (gpt-oss's only)")
    scheme = None if is_gguf(model_dir) or mxfp4 else read_scheme(raw, str(model_dir))
    quantized: set[str] = set()  # HF names of the weights a compressed-tensors checkpoint stores as int8
    if is_gguf(model_dir):
        weights: Iterator[tuple[str, CheckpointTensor]] = gguf_tensors(model_dir, raw)
    elif mxfp4:  # the experts dequantized as they are read
        weights = mxfp4_dequantized(iterate_weights(safetensors_files(model_dir)))
    elif scheme is not None:
        files = safetensors_files(model_dir)
        weights = dequantized(iterate_weights(files), weight_scales(files), quantized)
    else:
        weights = iterate_weights(safetensors_files(model_dir))
    torch_dtype = resolve_dtype(dtype, cfg.torch_dtype, device)
    try:
        model = DecoderForCausalLM(cfg, torch_dtype, device, tp, experts, stage)  # uninitialised: weights next
    except ValueError as exc:  # a dimension tensor parallelism cannot split
        raise ModelLoadError(str(exc)) from None
    with torch.no_grad():
        if is_gguf(model_dir) and quantization is None:  # only what the file quantized, each as its blocks say
            kept, requantized = file_block_methods(model, block_formats(model_dir))
            for format_method, linears in kept.items():
                model.hold_file_blocks(format_method, linears)  # loading copies their blocks in
            model.load_weights(weights)
            model.quantize_linears(REQUANTIZED, requantized)
        else:
            model.load_weights(weights)
            method = resolve_quantization(quantization, model_dir, scheme.method if scheme else None)
            model.quantize_linears(method, model.linears_of(quantized) if quantization is None and quantized else None)
    model.setup_rope(max_positions or cfg.max_position_embeddings)
    model.pack_linears()
    return model.eval()


# GGUF block formats a linear layer keeps as they are (their steps exact), by our method's name;
# a layer of any other format, or fused from tensors of two, is quantized again as REQUANTIZED.
BLOCKWISE = {"Q8_0": "q8_0", "Q5_0": "q8_0", "Q4_0": "q4_0", "Q4_1": "q4_1", "Q4_K": "q4_k"}
REQUANTIZED = "q8_0"


def file_block_methods(model: DecoderForCausalLM, formats: dict[str, str]) -> tuple[dict[str, set[str]], set[str]]:
    """For a GGUF file's quantized tensors (HF name -> GGML type): (method -> our linear layers that
    keep the file's blocks as that method, the layers quantized again). A layer whose tensors are
    of formats one `BLOCKWISE` method holds keeps their blocks (a Q4_K_M file of the 0.5B shape:
    q, k Q5_0 and v Q8_0, all q8_0); a layer of another format (Q6_K, Q5_K, ...), or fused from
    tensors of two methods, is dequantized and quantized again as `REQUANTIZED` (8 bits per block
    of 32: rounded again, finely, which the log says)."""
    kinds: dict[str, set[str]] = {}
    for hf_name, kind in formats.items():
        for linear in model.linears_of({hf_name}):
            kinds.setdefault(linear, set()).add(kind)
    kept: dict[str, set[str]] = {}
    requantized: set[str] = set()
    rounded: set[str] = set()
    for linear, found in kinds.items():
        methods = {BLOCKWISE.get(kind) for kind in found}
        method = methods.pop() if len(methods) == 1 else None
        if method is None:
            requantized.add(linear)
            rounded |= found
        else:
            kept.setdefault(method, set()).add(linear)
    if rounded:
        logger.info("%d linear layers of the GGUF file (%s blocks, or fused from two formats) are quantized again as "
                    "%s, a scale per 32 weights: rounded again, finely", len(requantized), "/".join(sorted(rounded)),
                    REQUANTIZED)
    return kept, requantized


def resolve_quantization(requested: str | None, model_dir: Path, stored: str | None) -> str | None:
    """The quantization to run: `requested` (--quantization), else the checkpoint's own (`stored`:
    a compressed-tensors scheme), else none. (A GGUF file's quantized tensors, without a request,
    keep their formats: `file_block_methods`.) Running a GGUF file's blocks as another method
    rounds its weights again: the log says so."""
    if requested not in (None, *QUANTIZATIONS):
        raise ModelLoadError(f"unsupported quantization {requested!r}; supported: {', '.join(QUANTIZATIONS)}")
    if requested is None:
        return stored
    formats = set(block_formats(model_dir).values()) if is_gguf(model_dir) else set()
    if formats and {BLOCKWISE.get(kind) for kind in formats} != {requested}:
        logger.info("the GGUF file's %s blocks are requantized as %s: rounded again, less faithful than the "
                    "file", "/".join(sorted(formats)), requested)
    return requested


def weight_scales(files: list[Path]) -> dict[str, torch.Tensor]:
    """Every `*.weight_scale` tensor of a compressed-tensors checkpoint, by name (read first: small)."""
    scales = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 -- a safetensors handle has keys() but is not iterable
                if name.endswith(".weight_scale"):
                    scales[name] = f.get_tensor(name)
    return scales


def load_llava(model_dir: str | Path, dtype: str = "auto", device: str = "cpu", max_positions: int | None = None,
               tp: TensorParallel = TensorParallel()) -> tuple[DecoderForCausalLM, LlavaVision, LlavaConfig]:
    """A LLaVA checkpoint: its decoder (this rank's shard) and its vision tower + projector (whole on
    every rank). Blocking: run it off the event loop."""
    model_dir = Path(model_dir)
    cfg = parse_llava_config(read_config_json(model_dir))
    torch_dtype = resolve_dtype(dtype, cfg.text.torch_dtype, device)
    try:
        decoder = DecoderForCausalLM(cfg.text, torch_dtype, device, tp)
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from None
    vision = LlavaVision(VisionConfig.from_hf(cfg.vision), cfg.text.hidden_size, cfg.feature_layer,
                         cfg.select_strategy, cfg.projector_act, cfg.projector_bias, torch_dtype, device)
    text_weights: list[tuple[str, torch.Tensor]] = []
    vision_weights: list[tuple[str, torch.Tensor]] = []
    for name, tensor in iterate_weights(safetensors_files(model_dir)):
        part, local = _llava_part(name)
        (vision_weights if part == "vision" else text_weights).append((local, tensor))
    with torch.no_grad():
        decoder.load_weights(text_weights)
        vision.load_weights(vision_weights, "LlavaForConditionalGeneration")
    decoder.setup_rope(max_positions or cfg.text.max_position_embeddings)
    decoder.pack_linears()
    return decoder.eval(), vision.eval(), cfg


def _llava_part(name: str) -> tuple[str, str]:
    """("text" | "vision", the name within that part) for a LLaVA checkpoint tensor, in the
    llava-hf layout (`language_model.model.*`, `vision_tower.vision_model.*`) or transformers 5's
    (`model.language_model.*`, `model.vision_tower.*`, `lm_head.weight`)."""
    if name.startswith(("model.vision_tower.", "model.multi_modal_projector.", "model.language_model.")):
        name = name.removeprefix("model.")
        if name.startswith("language_model."):
            return "text", "model." + name.removeprefix("language_model.")
    if name.startswith("vision_tower."):
        return "vision", name.removeprefix("vision_tower.").removeprefix("vision_model.")
    if name.startswith("multi_modal_projector."):
        return "vision", name.removeprefix("multi_modal_projector.")
    return "text", name.removeprefix("language_model.")


def load_encoder(model_dir: str | Path, dtype: str = "auto", device: str = "cpu") -> BertEncoder:
    """Build and load a BERT encoder. Blocking: run it off the event loop."""
    model_dir = Path(model_dir)
    cfg = EncoderConfig.from_hf(read_config_json(model_dir))
    if cfg.late_interaction and cfg.projection_dim is None:  # colbert-ai does not write it into config.json
        cfg = replace(cfg, projection_dim=_checkpoint_rows(safetensors_files(model_dir), PROJECTION_NAMES))
    model = BertEncoder(cfg, resolve_dtype(dtype, cfg.torch_dtype, device), device)
    with torch.no_grad():
        model.load_weights(iterate_weights(safetensors_files(model_dir)))
    return model.eval()


PROJECTION_NAMES = ("linear.weight", "colbert_linear.weight")


def _checkpoint_rows(files: list[Path], names: tuple[str, ...]) -> int | None:
    """The first dimension of the first tensor named one of `names`, read from the headers only."""
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 -- a safetensors handle has keys() but is not iterable
                if name.removeprefix("model.") in names:
                    return int(f.get_slice(name).get_shape()[0])
    return None
