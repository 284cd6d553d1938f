"""GGUF files (llama.cpp's format), read with the `gguf` package: an HF-style config from the
file's metadata, and its tensors under HF names (`trio-llm serve model.gguf --tokenizer HF_DIR`,
as vLLM takes them).

A Q8_0 tensor comes as its blocks (`gguf_tensors`, `Q8_0Blocks`: int8 steps with a scale per 32
weights), which a `q8_0` layer keeps as they are, and so a Q5_0 one (its steps less 16 are int8
steps with the block's scale); a Q4_0, Q4_1 or Q4_K one as 4-bit steps with a
scale and a low per 32 (`Q4Blocks`), which a `q4_0`, `q4_1` or `q4_k` layer keeps as they are.
Other quantized tensors are dequantized to float32 once at load, and by default run as `q8_0`
(engine/models/loader.py `file_block_methods`; docs/decisions.md, "Quantized weights"), which the
start-up log says, since that rounds the file's weights again (finely: 8 bits per 32 weights).
llama.cpp stores the Llama family's Q and K rows permuted for its rotary layout; they are put back
in HF order. Anything malformed (a truncated file, an unknown quantization type, a tensor of the
wrong shape, a header claiming absurd counts) is a `ModelLoadError` of one line.
"""

from __future__ import annotations

import functools
import struct
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.errors import ModelLoadError
from engine.models.weights import CheckpointTensor, FileBlocks, Q4Blocks, Q8_0Blocks, as_floats

# The block formats (and plain ones) this loader dequantizes; the names are GGML's.
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
                   "Q6_K")
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
HELD_AS_BLOCKS = ("Q8_0", "Q5_0", "Q4_0", "Q4_1", "Q4_K")  # formats whose blocks a layer keeps as they are
MAX_COUNT = 1 << 16  # tensors, or metadata keys, a header may claim
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}


def is_gguf(path: str | Path) -> bool:
    return str(path).endswith(".gguf")


@functools.cache
def _plain_array_reader() -> Any:
    """gguf's `GGUFReader`, reading through a plain array over its memory map.

    The reader parses the header one value at a time, each a slice of its `np.memmap`, and numpy
    finalises every slice of a memmap as a memmap: for a 152,000-token vocabulary that was 8.4 s
    of a 0.5B file's start-up (2.6 s through a plain array). The reader keeps the map in its public
    `data`; this class keeps it as a plain `ndarray` over the same mapping (still read-only, and
    the tensors' arrays still views of the file)."""
    from gguf import GGUFReader, GGUFValueType

    class PlainArrayReader(GGUFReader):
        @property  # type: ignore[override]  # a plain array where gguf declares its memmap
        def data(self) -> np.ndarray:
            return self._plain

        @data.setter
        def data(self, value: np.ndarray) -> None:
            self._plain = value.view(np.ndarray) if isinstance(value, np.memmap) else value

        def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list[Any], list[int], list[Any]]:
            """An array's items are stepped over, not read (`_SKIPPED_ARRAYS`)."""
            if raw_type != GGUFValueType.ARRAY or self.byte_order == "S":  # "S": the file's byte order swapped
                return super()._get_field_parts(orig_offs, raw_type)
            item_type = GGUFValueType(int(self._get(orig_offs, np.uint32)[0]))
            count = int(self._get(orig_offs + 4, np.uint64)[0])
            items = orig_offs + 12
            if item_type == GGUFValueType.STRING:
                end = _past_strings(self._plain, items, count)
            elif item_type in self.gguf_scalar_to_np:
                end = items + count * np.dtype(self.gguf_scalar_to_np[item_type]).itemsize
                if end > len(self._plain):
                    raise ValueError("an array runs past the end of the file")
            else:  # arrays of arrays: gguf's own walk
                return super()._get_field_parts(orig_offs, raw_type)
            return end - orig_offs, [], [], [GGUFValueType.ARRAY, item_type]

    return PlainArrayReader


# gguf parses every item of every array in the header, one numpy view each: a 152,000-token
# vocabulary, its token types and 151,000 merges were 2.5 s of the 0.5B file's warm start. The
# engine reads only scalars from the header (the tokenizer comes from the checkpoint directory), so
# arrays are stepped over; `_value` refuses to read one.
_SKIPPED_ARRAYS = "arrays in a GGUF header are not read"


def _past_strings(data: np.ndarray, offset: int, count: int) -> int:
    """The offset after `count` GGUF strings (a little-endian uint64 length, then the bytes) at `offset`."""
    view, size = memoryview(data), len(data)  # type: ignore[arg-type]  # a uint8 array is a buffer
    for _ in range(count):
        offset += 8 + int.from_bytes(view[offset:offset + 8], "little")
        if offset > size:  # a cut or hostile file: stop at its end, not after `count` steps
            raise ValueError("a string array runs past the end of the file")
    return offset


@functools.lru_cache(maxsize=4)
def gguf_reader(path: str) -> Any:
    """The file's `GGUFReader` (memory-mapped), once its header's counts are sane."""
    file = Path(path)
    if not file.is_file():
        raise ModelLoadError(f"{path}: no such GGUF file")
    try:
        with file.open("rb") as f:
            header = f.read(24)
        if len(header) < 24 or header[:4] != b"GGUF":
            raise ValueError("no GGUF header")
        tensors, keys = struct.unpack("<QQ", header[8:24])
        if tensors > MAX_COUNT or keys > MAX_COUNT:
            raise ValueError(f"the header claims {tensors} tensors and {keys} metadata keys")
        return _plain_array_reader()(path, "r")
    except ModelLoadError:
        raise
    except Exception as exc:  # the gguf package raises what numpy and struct raise on a bad file
        raise ModelLoadError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})") from None


def _value(reader: Any, key: str) -> Any:
    field = reader.get_field(key)
    if field is None:
        return None
    if field.types and field.types[0].name == "ARRAY":
        raise ModelLoadError(f"GGUF metadata {key!r}: {_SKIPPED_ARRAYS}")
    try:
        return field.contents()
    except Exception as exc:
        raise ModelLoadError(f"GGUF metadata {key!r} is unreadable ({type(exc).__name__}: {exc})") from None


def _tensors(reader: Any) -> dict[str, Any]:
    return {tensor.name: tensor for tensor in reader.tensors}


def gguf_config(path: str | Path) -> dict[str, Any]:
    """The HF `config.json` the file's metadata amounts to (architecture, sizes, rope, EOS)."""
    reader = gguf_reader(str(path))
    quantization_types(path)  # an unsupported tensor type is named before anything else
    arch = _value(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(f"{path}: unsupported GGUF architecture {arch!r}; supported: {', '.join(ARCHITECTURES)}")
    tensors = _tensors(reader)
    embed = tensors.get("token_embd.weight")
    if embed is None:
        raise ModelLoadError(f"{path}: the GGUF file has no token_embd.weight")

    def number(key: str, default: Any = None) -> Any:
        value = _value(reader, f"{arch}.{key}")
        if value is None and default is None:
            raise ModelLoadError(f"{path}: GGUF metadata lacks {arch}.{key}")
        return default if value is None else value

    heads = int(number("attention.head_count"))
    config = {
        "architectures": [ARCHITECTURES[arch]], "model_type": arch,
        "hidden_size": int(number("embedding_length")), "num_hidden_layers": int(number("block_count")),
        "intermediate_size": int(number("feed_forward_length")), "num_attention_heads": heads,
        "num_key_value_heads": int(number("attention.head_count_kv", heads)),
        "rms_norm_eps": float(number("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(number("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(number("context_length")),
        "vocab_size": int(embed.shape[1]) if len(embed.shape) > 1 else 0,
        "tie_word_embeddings": "output.weight" not in tensors, "dtype": "float32",
        "eos_token_id": _value(reader, "tokenizer.ggml.eos_token_id"),
        "bos_token_id": _value(reader, "tokenizer.ggml.bos_token_id"),
    }
    key_length = _value(reader, f"{arch}.attention.key_length")
    if key_length is not None:
        config["head_dim"] = int(key_length)
    if arch == "qwen2":
        config["qkv_bias"] = "blk.0.attn_q.bias" in tensors
    if arch == "llama":
        config["attention_bias"] = "blk.0.attn_q.bias" in tensors
    return config


def quantization_types(path: str | Path) -> set[str]:
    """The GGML types of the file's tensors; an unsupported one is refused, naming it and its tensor."""
    types = set()
    for name, tensor in _tensors(gguf_reader(str(path))).items():
        kind = getattr(tensor.tensor_type, "name", str(tensor.tensor_type))
        if kind not in SUPPORTED_TYPES:
            raise ModelLoadError(f"{path}: tensor {name} has GGML type {kind}, which is not supported; supported: "
                                 f"{', '.join(SUPPORTED_TYPES)}")
        types.add(kind)
    return types


def block_formats(path: str | Path) -> dict[str, str]:
    """HF weight name -> GGML type of each tensor the file holds in a block format."""
    quantization_types(path)
    found = {}
    for name, tensor in _tensors(gguf_reader(str(path))).items():
        kind = getattr(tensor.tensor_type, "name", str(tensor.tensor_type))
        hf_name = hf_tensor_name(name)
        if kind not in ("F32", "F16", "BF16") and hf_name is not None:
            found[hf_name] = kind
    return found


def gguf_weights(path: str | Path, config: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor under its HF name, as float32, in HF layout."""
    return as_floats(gguf_tensors(path, config))


def gguf_tensors(path: str | Path, config: dict[str, Any]) -> Iterator[tuple[str, CheckpointTensor]]:
    """Every tensor under its HF name in HF layout: a 2-D tensor of a `HELD_AS_BLOCKS` format as
    its blocks (`Q8_0Blocks`, `Q4Blocks`: views of the file where its layout is the layers'), any
    other as float32."""
    from gguf import quants

    quantization_types(path)
    arch = config["model_type"]
    for name, tensor in _tensors(gguf_reader(str(path))).items():
        hf_name = hf_tensor_name(name)
        if hf_name is None:
            raise ModelLoadError(f"{path}: unexpected GGUF tensor {name!r}")
        try:
            shape = tuple(int(d) for d in reversed(tensor.shape))  # GGML lists the fastest dimension first
            value: CheckpointTensor
            kind = tensor.tensor_type.name
            if kind in HELD_AS_BLOCKS and len(shape) == 2:
                raw = _read_only_view(tensor.data)
                value = _file_blocks(raw, shape[0], kind)
                if value.shape != shape:
                    raise ValueError(f"{value.shape[1]} features in its blocks, {shape[1]} in its shape")
            else:
                data = quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
                # A copy: the file is read-only.
                value = torch.from_numpy(np.array(data, dtype=np.float32)).reshape(shape)
        except Exception as exc:
            raise ModelLoadError(f"{path}: tensor {name} is unreadable ({type(exc).__name__}: {exc})") from None
        if arch == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config["num_attention_heads"] if "q_proj" in hf_name else config["num_key_value_heads"]
            value = unpermute_rotary(value, heads, name)
        yield hf_name, value


def _file_blocks(raw: torch.Tensor, rows: int, kind: str) -> FileBlocks:
    """The blocks of a `HELD_AS_BLOCKS` tensor: Q8_0's, and Q5_0's as Q8_0's; 4-bit ones as `Q4Blocks`."""
    if kind == "Q8_0":
        return Q8_0Blocks.from_raw(raw, rows)
    if kind == "Q5_0":
        return Q8_0Blocks.from_q5_0(raw, rows)
    return Q4Blocks.from_raw(raw, rows, kind)


def _read_only_view(data: np.ndarray) -> torch.Tensor:
    """A tensor over the file's mapped bytes, without a copy. torch warns that it cannot protect a
    read-only array from writes: nothing writes to it (loading copies out of it)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(np.asarray(data, dtype=np.uint8))


def hf_tensor_name(name: str) -> str | None:
    """The HF name of a llama.cpp tensor name (None: not one the supported architectures have)."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    return None


def unpermute_rotary(weight: CheckpointTensor, heads: int, name: str) -> CheckpointTensor:
    """Undo llama.cpp's permutation of a Llama Q or K projection (its rows, per head, interleave
    the two rotary halves)."""
    rows = weight.shape[0]
    if heads < 1 or rows % (2 * heads):
        raise ModelLoadError(f"GGUF tensor {name} has {rows} rows, which {heads} heads cannot split")
    if isinstance(weight, FileBlocks):
        return weight.map(lambda part: _unpermuted_rows(part, heads))
    return _unpermuted_rows(weight, heads)


def _unpermuted_rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    rows = weight.shape[0]
    return weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)
