"""Quantized linear layers: int8 weight-only (`--quantization int8`, and quantized GGUF files),
int8 with int8 activations too (`--quantization w8a8`), and 4-bit weight-only in groups of 32
(`--quantization int4`).

Each weight row (an output channel) is stored as int8 with one scale, `max |w| / 127`; the
activations stay in the model's dtype. A decode step reads every weight once, so a quarter of
float32's bytes is most of the win. The matmul is torch's CPU kernel for exactly this layout,
`aten._weight_int8pack_mm` (gpt-fast's, which inductor also calls from compiled graphs). Its
float32 path is slow on this CPU build and its bfloat16 path fast (docs/benchmarks.md,
"Quantized weights"), so with float32 activations the rows are cast to bfloat16 for the
matmul and the result back: bfloat16's rounding of the activations, next to int8's of the
weights, moves logits by about the same as the weights' own rounding.

At one row that kernel streams the weights at ~12 GB/s of the ~30 a read reaches here. So in the
compiled decode graph a batch of one row takes `int8_row_times` instead: the same products and
roundings written as a product and a sum, which inductor compiles into one loop over the weight
rows (~22 GB/s). A `torch.cond` on the row count picks it inside the one exported graph; eagerly
(prompts, `--enforce-eager`) torch's kernel runs at every size.

That kernel is compute-bound beyond a row or two (16 rows of the 0.5B shape's LM head: 47 ms,
against 26 for float32 and 14 for an int8 x int8 matmul), so `w8a8` exists for batched serving:
activations quantized per row at run time, as llama.cpp's Q8_0 does, and `torch._int_mm`.

`q8_0` keeps a scale per block of 32 weights of a row, as GGUF's Q8_0 stores them: a Q8_0 file's
blocks come back exactly (its dequantized weights quantize to the same steps and scales), where one
scale per row would round them again, coarsely (a row's largest weight sets its step). It is the
default for a Q8_0 GGUF file. One row (a decode at batch 1) is `q8_0_row_times`, the blockwise form
of `int8_row_times`, fused by inductor in the compiled decode graph (and the LM head's graph),
activations in float32 (llama.cpp rounds them to int8 per block: this rounds less); so do up to
16 rows (a batch of decodes), on our kernel, and up to 1,024 (prompt steps too) where the layer
holds auto's tiles. More rows dequantize the weight to
bfloat16 and multiply in bfloat16 where the CPU does that in hardware, else in float32
(`q8_0_matmul_dtype`: without AVX-512 BF16 or AMX, oneDNN's bfloat16 matmul is 4x slower than
its float32 one).

`int4` halves the bytes again: each group of 32 weights of a row as 4-bit steps between its
minimum and maximum, run by `aten._weight_int4pack_mm_for_cpu` (bfloat16 activations). It is the
fastest at one row (the 0.5B shape's LM head: 3.8 ms against 8.2 for int8) and slower than w8a8
from a few rows on (26 against 14 ms at 16), and it rounds more (a few percent of a logit).
`q4_0`, `q4_1` and `q4_k` hold a GGUF file's 4-bit blocks as they are: per block of 32, the steps
two a byte and a float32 scale and low (weight = scale * step + low), which Q4_0's, Q4_1's and
Q4_K's blocks all come to exactly. Up to 16 rows run our kernel over them (engine/kernels/q4_rows.c,
float32 activations and sums, as q8_0's), more rows dequantize and matmul. They are the default for
a file's Q4_0, Q4_1 and Q4_K tensors; `--quantization q4_0` makes Q4_0's blocks of a float model.
(Before this layout, `q4_0` ran torch's int4 kernel: bfloat16 scales and activations, and slow at
prompts; docs/decisions.md, "4-bit files keep their blocks".)
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.kernels import q4_rows as q4_kernel
from engine.kernels import q8_0_quantize
from engine.kernels import q8_0_rows as q8_0_kernel
from engine.kernels.operators import operator
from engine.models.weights import unpacked_steps

INT4_GROUP = 32  # weights per scale and zero point in int4 (the kernel takes 32, 64, 128 or 256)
INT4_ROW_BLOCK = 16  # the int4 kernel packs output rows in blocks of 16
Q8_0_BLOCK = 32  # weights per scale in q8_0 (GGUF's Q8_0 block), and per (scale, low) in q4_*
Q4_BLOCK_BYTES = 16  # a q4_* block's 32 steps, two a byte
# 4-bit steps with a float32 scale and low per 32 (`q4_linear`): GGUF's Q4_0, Q4_1 and Q4_K, each
# exactly; `q4_0` is also what `--quantization q4_0` makes of a float model.
Q4_METHODS = ("q4_0", "q4_1", "q4_k")
Dequantize = Callable[[torch.Tensor, torch.Tensor, torch.dtype], torch.Tensor]
# The kernel's bfloat16 path reads the input features in blocks of 16: any other count gives wrong
# sums without an error (measured: 24 or 40 features), so such a layer stays float.
FEATURE_BLOCK = 16
INDUCTOR_PLAIN_SUM = 4096  # inductor sums up to this many floats plainly (see int8_row_times)
EAGER_SLICE_WEIGHTS = 1 << 20  # q8_0 weights dequantized at a time outside a graph (4 MiB of float32)


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weight [N, K], float32 scales [N]): symmetric, one scale per output row."""
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return q.contiguous(), scales


def kernel_dtype(dtype: torch.dtype) -> torch.dtype:
    """The activation dtype the int8 kernel runs in for a model of `dtype`."""
    return torch.float16 if dtype == torch.float16 else torch.bfloat16


_NATIVE_BFLOAT16 = bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def native_bfloat16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX-512 BF16 or AMX). Without, oneDNN
    widens it to float32 first: a [2048, 896] x [896, 9728] matmul took 629 ms in bfloat16 and
    153 ms in float32 on a 2-core AVX-512 VNNI Xeon (docs/benchmarks.md). Asked once, at import:
    export cannot trace the question."""
    return _NATIVE_BFLOAT16


def q8_0_matmul_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype q8_0 weights are dequantized to, and the rows cast to, for a matmul of many rows
    with activations of `dtype`: bfloat16 (half the bytes written and read back) where the CPU
    multiplies it natively, float32 where it does not; reduced activations keep their dtype."""
    if dtype in (torch.float16, torch.bfloat16):
        return dtype
    return torch.bfloat16 if native_bfloat16() else torch.float32


def int8_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
    """`x @ (qweight * scales[:, None]).T + bias`, in x's dtype. `scales` are in the kernel's dtype.

    In an exported graph (the compiled decode step) a batch of one row takes `int8_row_times`
    instead, by a `torch.cond` on the row count: the graph serves every batch size."""
    rows = x.reshape(-1, x.shape[-1]).to(scales.dtype).contiguous()
    if torch.compiler.is_exporting():
        y = torch.cond(rows.shape[0] == 1, int8_row_times, int8_pack_mm, (rows, qweight, scales))
    else:
        y = int8_pack_mm(rows, qweight, scales)
    y = y.reshape(*x.shape[:-1], qweight.shape[0]).to(x.dtype)
    return y if bias is None else y + bias


def int8_pack_mm(rows: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """torch's kernel for int8 rows with a scale each (activations in the scales' dtype)."""
    return torch.ops.aten._weight_int8pack_mm(rows, qweight, scales)


def int8_row_times(rows: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """What `int8_pack_mm` computes, written as a product and a sum for inductor to fuse: each
    weight row is read once, widened in registers and multiplied into the activations, with
    nothing materialised. At one row it streams the weights at ~2x the kernel's rate (the 0.5B
    shape's linears: 27 against 45 ms), but it widens every weight again for each further row, so
    only batches of one take it. The activations and the result are rounded to the scales' dtype
    as the kernel rounds them."""
    # Only ever called with one row, but traced with a symbolic count: row 0 gives inductor a
    # static shape to split over the threads (on [rows, N] it parallelised over the one row).
    # Inductor sums more than 4096 floats through a slower, more exact helper (cascade sums:
    # the 0.5B shape's down projection ran at half the others' rate), so longer rows are summed
    # in equal pieces of at most 4096, then the pieces.
    features = qweight.shape[1]
    pieces = next(p for p in range(-(-features // INDUCTOR_PLAIN_SUM), features + 1) if features % p == 0)
    products = rows[0].float().reshape(pieces, -1) * qweight.float().reshape(qweight.shape[0], pieces, -1)
    one = (products.sum(-1).sum(-1) * scales.float()).to(scales.dtype)
    return one.unsqueeze(0).expand(rows.shape[0], -1).contiguous()


def quantize_per_block(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 weight [N, K], float32 scales [N, K / 32]): symmetric, one scale per block of 32
    features of a row, `max |w| / 127` (llama.cpp's Q8_0, which it reproduces from Q8_0's own
    dequantized weights: each block's largest step is 127)."""
    done = q8_0_quantize.quantize(weight, torch.get_num_threads())  # the same, in one pass
    return done if done is not None else quantize_per_block_in_torch(weight)


def quantize_per_block_in_torch(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_per_block` in torch's ops: any dtype, and where our kernel cannot be built."""
    rows, features = weight.shape
    blocks = weight.detach().float().reshape(rows, features // Q8_0_BLOCK, Q8_0_BLOCK)
    scales = (blocks.abs().amax(dim=-1) / 127.0).clamp(min=1e-12)
    q = torch.round(blocks / scales[..., None]).clamp(-127, 127).to(torch.int8)
    return q.reshape(rows, features).contiguous(), scales.contiguous()


def q8_0_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                bias: torch.Tensor | None, activations: str = "auto",
                packed: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ W.T + bias` with W in `quantize_per_block`'s layout, in x's dtype. Up to 16 rows (a
    batch of decodes) take our C kernel over the blocks (engine/kernels/q8_0_rows.c: in an exported
    graph as an operator, by a `torch.cond` on the row count; where it cannot be built, one row
    takes `q8_0_row_times`); more rows (prompts) `q8_0_dequantized_mm`, except that a layer with
    `packed` tiles takes up to 1,024 rows on them. `activations` (`--q8-0-activations`) is how those
    rows meet the weight: "auto" in two int8 levels where the layer holds `packed` tiles (any width),
    else as float32 rows, or in two levels
    for 10 or more rows through at most 512 features (`q8_0_rows.AUTO_KERNEL`);
    "float32" always as they are; "int8" rounded to int8 per block of 32, as llama.cpp multiplies
    (`q8_0_int8_rows`). `packed`: auto's tiles of the weight laid out for its two levels
    (`q8_0_rows.pack_tiles`, held by the layer), where it has them."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    kernel = q8_0_kernel.AUTO_KERNEL if activations == "auto" else q8_0_kernel.KERNEL
    if activations == "int8":
        y = q8_0_int8_linear(rows, qweight, scales)
    elif activations == "auto" and packed is not None:
        y = q8_0_packed_linear(rows, qweight, scales, packed)
    elif torch.compiler.is_exporting():
        if kernel.available():
            few_rows = q8_0_auto_rows if activations == "auto" else q8_0_kernel_rows
            y = torch.cond(rows.shape[0] <= q8_0_kernel.MAX_ROWS, few_rows, q8_0_dequantized_mm,
                           (rows, qweight, scales))
        else:
            y = torch.cond(rows.shape[0] == 1, q8_0_row_times, q8_0_dequantized_mm, (rows, qweight, scales))
    else:  # eagerly a few rows run our kernel over the blocks as they are, where it applies
        few = None if torch.compiler.is_compiling() else kernel.row_times(rows, qweight, scales,
                                                                          torch.get_num_threads())
        y = few if few is not None else q8_0_dequantized_mm(rows, qweight, scales)
    y = y.reshape(*x.shape[:-1], qweight.shape[0])
    return y if bias is None else y + bias


def q8_0_int8_linear(rows: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Rows [T, k] times the blockwise weight with up to 16 rows rounded to int8 per block
    (`q8_0_int8_rows`), more (prompts) `q8_0_dequantized_mm`, in the rows' dtype."""
    if torch.compiler.is_exporting():
        return torch.cond(rows.shape[0] <= q8_0_kernel.MAX_ROWS, q8_0_int8_rows, q8_0_dequantized_mm,
                          (rows, qweight, scales))
    few = None if torch.compiler.is_compiling() else q8_0_kernel.int8_row_times(rows, qweight, scales,
                                                                                  torch.get_num_threads())
    return few.to(rows.dtype) if few is not None else q8_0_dequantized_mm(rows, qweight, scales)


def q8_0_int8_rows(rows: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """A few rows times the blockwise weight as llama.cpp's Q8_0 x Q8_0 product: each row rounded to
    int8 per block of 32 (a float32 scale each), int8 x int8 products summed in int32 per block, then
    scaled (engine/kernels/q8_0_rows.c `q8_0_rows_int8`, AVX-512 VNNI; in an exported graph the
    operator `trio_llm::q8_0_rows_int8`, called through its C shim)."""
    return torch.ops.trio_llm.q8_0_rows_int8(rows.float().contiguous(), qweight, scales).to(rows.dtype)


def q8_0_kernel_rows(rows: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """A few rows (a batch of decodes) times the blockwise weight in an exported graph: our kernel
    as the graph's operator (`trio_llm::q8_0_rows`, called by the package through its C shim, on
    the step's threads), which reads the weight once for all of them."""
    return torch.ops.trio_llm.q8_0_rows(rows.float().contiguous(), qweight, scales).to(rows.dtype)


def q8_0_packed_linear(rows: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                       packed: torch.Tensor) -> torch.Tensor:
    """Rows [T, k] times the blockwise weight as auto multiplies, with the weight's tiles packed:
    up to 1,024 rows (`INT8_MAX_ROWS`: a batch of decodes, a prompt step) by the operator
    `trio_llm::q8_0_rows_packed` (in an exported graph by a `torch.cond` on the row count), more
    `q8_0_dequantized_mm`, in the rows' dtype."""
    if torch.compiler.is_exporting():
        return torch.cond(rows.shape[0] <= q8_0_kernel.INT8_MAX_ROWS, q8_0_packed_rows, q8_0_unpacked_mm,
                          (rows, qweight, scales, packed))
    few = None if torch.compiler.is_compiling() else q8_0_kernel.packed_row_times(
        rows.float(), qweight, scales, packed, torch.get_num_threads())
    return few.to(rows.dtype) if few is not None else q8_0_dequantized_mm(rows, qweight, scales)


def q8_0_packed_rows(rows: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                     packed: torch.Tensor) -> torch.Tensor:
    """`torch.cond`'s branch for a batch of decodes: the operator on the packed tiles."""
    return torch.ops.trio_llm.q8_0_rows_packed(rows.float().contiguous(), qweight, scales, packed).to(rows.dtype)


def q8_0_unpacked_mm(rows: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                     packed: torch.Tensor) -> torch.Tensor:
    """`torch.cond`'s branch for prompts: `q8_0_dequantized_mm`, the packed tiles unread."""
    return q8_0_dequantized_mm(rows, qweight, scales)


def q8_0_auto_rows(rows: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """`q8_0_kernel_rows` as `--q8-0-activations auto` multiplies: the operator
    `trio_llm::q8_0_rows_auto`, float32 rows or (10 or more through at most 512 features) two int8
    levels of them."""
    return torch.ops.trio_llm.q8_0_rows_auto(rows.float().contiguous(), qweight, scales).to(rows.dtype)


def q4_linear(x: torch.Tensor, qweight: torch.Tensor, params: torch.Tensor,
              bias: torch.Tensor | None) -> torch.Tensor:
    """`x @ W.T + bias` with W a `q4_*` weight (`Q4_METHODS`: packed 4-bit steps [n, k / 2] and
    float32 (scale, low) per block of 32, [n, k / 32, 2]), in x's dtype. Up to 16 rows take our C
    kernel over the packed steps (engine/kernels/q4_rows.c; in an exported graph as an operator, by
    a `torch.cond` on the row count), summing in float32; more rows `q4_dequantized_mm`."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    if torch.compiler.is_exporting() and q4_kernel.available():
        y = torch.cond(rows.shape[0] <= q4_kernel.MAX_ROWS, q4_kernel_rows, q4_dequantized_mm, (rows, qweight, params))
    else:
        few = None if torch.compiler.is_compiling() else q4_kernel.row_times(rows.float(), qweight, params,
                                                                             torch.get_num_threads())
        y = few.to(rows.dtype) if few is not None else q4_dequantized_mm(rows, qweight, params)
    y = y.reshape(*x.shape[:-1], qweight.shape[0])
    return y if bias is None else y + bias


def q4_kernel_rows(rows: torch.Tensor, qweight: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """A few rows times a `q4_*` weight in an exported graph: `trio_llm::q4_rows`, through its C shim."""
    return torch.ops.trio_llm.q4_rows(rows.float().contiguous(), qweight, params).to(rows.dtype)


def empty_block_storage(method: str, rows: int, features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialised (qweight, qscales) of a `rows` x `features` weight held as `method`'s blocks:
    int8 steps and a float32 scale per 32 (q8_0); packed 4-bit steps and a float32 (scale, low) per 32
    (`Q4_METHODS`)."""
    if method in Q4_METHODS:
        return (torch.empty(rows, features // 2, dtype=torch.uint8),
                torch.empty(rows, features // Q8_0_BLOCK, 2, dtype=torch.float32))
    return torch.empty(rows, features, dtype=torch.int8), torch.empty(rows, features // Q8_0_BLOCK)


def q8_0_row_times(rows: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """One row times the blockwise weight, written as one product and one sum for inductor to fuse
    (as `int8_row_times`, in equal pieces of at most 4096): each weight times its block's scale and
    the row's feature, every weight read once, in float32. Summing each block first and then the
    blocks made inductor write the [rows, blocks] partial sums out between two loops: 15-25% slower.
    Eagerly it would materialise the products."""
    count, features = qweight.shape
    pieces = next(p for p in range(-(-features // INDUCTOR_PLAIN_SUM), features + 1) if features % p == 0)
    blocks = features // Q8_0_BLOCK
    scaled = (qweight.float().reshape(count, blocks, Q8_0_BLOCK) * scales.reshape(count, blocks, 1))
    one = (rows[0].float().reshape(pieces, -1) * scaled.reshape(count, pieces, -1)).sum(-1).sum(-1).to(rows.dtype)
    return one.unsqueeze(0).expand(rows.shape[0], -1).contiguous()


def q8_0_dequantized_mm(rows: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The weight dequantized to `q8_0_matmul_dtype` (bfloat16 for a float32 model where the CPU
    multiplies bfloat16 natively, else float32), then one matmul: each step writes and reads the
    whole weight again, which prompts (many rows) amortise.

    Outside a graph, a slice of the weight's rows at a time (`EAGER_SLICE_WEIGHTS`): dequantized
    whole, the 0.5B shape's tied LM head was 545 MB of float32 temporaries written and read back
    every token, and its eager steps (a first start's, while the graphs compile in the background)
    ran 0.4 tokens a second. In a graph inductor fuses the dequantization into one pass."""
    return _sliced_dequantized_mm(rows, qweight, scales, q8_0_weight)


def q4_dequantized_mm(rows: torch.Tensor, qweight: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """`q8_0_dequantized_mm` for a `q4_*` weight: many rows (prompts)."""
    return _sliced_dequantized_mm(rows, qweight, params, q4_weight)


def _sliced_dequantized_mm(rows: torch.Tensor, qweight: torch.Tensor, params: torch.Tensor,
                           dequantize: Dequantize) -> torch.Tensor:
    count, features = qweight.shape[0], rows.shape[-1]
    dtype = q8_0_matmul_dtype(rows.dtype)
    step = max(1, EAGER_SLICE_WEIGHTS // features)
    if torch.compiler.is_compiling() or count <= step:
        return _dequantized_mm(rows, qweight, params, dtype, dequantize)
    out = torch.empty(rows.shape[0], count, dtype=rows.dtype, device=rows.device)
    for start in range(0, count, step):
        part = slice(start, start + step)
        out[:, part] = _dequantized_mm(rows, qweight[part], params[part], dtype, dequantize)
    return out


def _dequantized_mm(rows: torch.Tensor, qweight: torch.Tensor, params: torch.Tensor, dtype: torch.dtype,
                    dequantize: Dequantize) -> torch.Tensor:
    return (rows.to(dtype) @ dequantize(qweight, params, dtype).t()).to(rows.dtype)


def q8_0_weight(qweight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A `q8_0` weight [n, k] in `dtype`: each step times its block's scale (rounded once)."""
    count, features = qweight.shape
    return (qweight.reshape(count, -1, Q8_0_BLOCK).float() * scales[..., None]).to(dtype).reshape(count, features)


def q4_weight(qweight: torch.Tensor, params: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A `q4_*` weight [n, k] in `dtype`: each step times its block's scale plus its low, as
    `engine.models.weights.Q4Blocks.dequantized` (and gguf) compute it."""
    count = qweight.shape[0]
    packed = qweight.reshape(count, -1, Q4_BLOCK_BYTES)
    steps = unpacked_steps(packed).float()
    return (steps * params[..., :1] + params[..., 1:]).to(dtype).reshape(count, -1)


def w8a8_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
    """`--quantization w8a8`: the int8 rows times each activation row quantized to int8 with its
    own scale (`max |x| / 127`, per row, so a row's result never depends on the rest of the
    batch), an int8 x int8 -> int32 matmul (`torch._int_mm`, VNNI on this CPU), then both scales.
    llama.cpp's Q8_0 quantizes activations the same way, in blocks of 32 features."""
    rows = x.reshape(-1, x.shape[-1]).float()
    row_scales = (rows.abs().amax(dim=1, keepdim=True) / 127.0).clamp(min=1e-12)
    quantized = torch.round(rows / row_scales).clamp(-127, 127).to(torch.int8)
    y = torch._int_mm(quantized, qweight.t()).float() * row_scales * scales
    y = y.reshape(*x.shape[:-1], qweight.shape[0]).to(x.dtype)
    return y if bias is None else y + bias


def can_quantize(weight: torch.Tensor, method: str = "int8") -> bool:
    """A 2-D CPU weight whose shape `method`'s kernel takes (features in blocks of 16; for int4
    groups of 32 features and rows in blocks of 16)."""
    if weight.dim() != 2 or weight.device.type != "cpu" or weight.shape[1] % FEATURE_BLOCK:
        return False
    if method == "q8_0" or method in Q4_METHODS:
        return weight.shape[1] % Q8_0_BLOCK == 0
    return method != "int4" or (weight.shape[1] % INT4_GROUP == 0 and weight.shape[0] % INT4_ROW_BLOCK == 0)


def quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed 4-bit rows, bfloat16 scales and zero points [K / 32, N, 2]) in the layout of
    `aten._weight_int4pack_mm_for_cpu`: each group of 32 as 16 steps from its minimum to maximum."""
    rows, features = weight.shape
    groups = weight.detach().float().reshape(rows, features // INT4_GROUP, INT4_GROUP)
    low, high = groups.amin(dim=-1, keepdim=True), groups.amax(dim=-1, keepdim=True)
    step = ((high - low) / 15).clamp(min=1e-12)
    q = torch.round((groups - low) / step).clamp(0, 15).to(torch.int32).reshape(rows, features)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
    # The kernel computes (q - 8) * scale + zero: the zero point is the value of step 8.
    scales_and_zeros = torch.stack([step.squeeze(-1).t(), (low + 8 * step).squeeze(-1).t()], dim=-1)
    return packed, scales_and_zeros.to(torch.bfloat16).contiguous()


def q4_0_steps(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's Q4_0 of `weight` [N, K]: (steps [N, K] in 0..15, int32; float32 scales [N, K / 32])
    with w = (step - 8) * scale. Per block of 32 features of a row the scale is the block's
    largest-magnitude weight / -8 and a step trunc(w / scale + 8.5) capped at 15, as ggml computes
    them. On a Q4_0 file's dequantized weights this gives back the file's steps and scales exactly:
    its largest-magnitude weight is step 0, -8 times the scale."""
    rows, features = weight.shape
    blocks = weight.detach().float().reshape(rows, features // INT4_GROUP, INT4_GROUP)
    peak = blocks.gather(-1, blocks.abs().argmax(dim=-1, keepdim=True))
    scales = peak / -8
    inverse = torch.where(scales == 0, torch.zeros_like(scales), 1 / scales)
    steps = torch.trunc(blocks * inverse + 8.5).clamp(0, 15).to(torch.int32).reshape(rows, features)
    return steps, scales.squeeze(-1)


def quantize_q4_0(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`q4_0_steps` as a `q4_*` weight (`q4_linear`): the steps packed two a byte (a block's first
    16 in the low halves, GGUF's layout), and per block (scale, -8 scale)."""
    steps, scales = q4_0_steps(weight)
    blocks = steps.to(torch.uint8).reshape(steps.shape[0], -1, Q8_0_BLOCK)
    packed = blocks[..., :Q4_BLOCK_BYTES] | (blocks[..., Q4_BLOCK_BYTES:] << 4)
    return packed.reshape(steps.shape[0], -1).contiguous(), torch.stack([scales, -8 * scales], dim=-1).contiguous()


@operator("trio_llm::int4pack_mm")
def int4pack_mm(rows: torch.Tensor, packed: torch.Tensor, group: int, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    """torch's int4 kernel, opaque to inductor. Inductor lowers `_weight_int4pack_mm_for_cpu` with
    its group size as a tensor constant of the graph's own, which an AOTInductor package whose
    constants are the model's tensors (passed by reference) cannot be given: the package compiled
    and then did not load (`KeyError: 'constant50'`), and int4 and q4_0 models ran on
    `torch.compile`. Called as this op, the exported graph calls the kernel through torch's proxy
    executor, the group size an argument."""
    return torch.ops.aten._weight_int4pack_mm_for_cpu(rows, packed, group, scales_and_zeros)


@int4pack_mm.register_fake
def _int4pack_mm_shape(rows: torch.Tensor, packed: torch.Tensor, group: int,
                       scales_and_zeros: torch.Tensor) -> torch.Tensor:
    return rows.new_empty((rows.shape[0], scales_and_zeros.shape[1]))


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
    """`x @ W.T + bias` with W in `quantize_int4`'s layout, in x's dtype."""
    rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16).contiguous()
    if torch.compiler.is_exporting():
        y = int4pack_mm(rows, packed, INT4_GROUP, scales_and_zeros)
    else:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, packed, INT4_GROUP, scales_and_zeros)
    y = y.reshape(*x.shape[:-1], scales_and_zeros.shape[1]).to(x.dtype)
    return y if bias is None else y + bias


QUANTIZED_MATMULS = {"int8": int8_linear, "w8a8": w8a8_linear, "int4": int4_linear, "q8_0": q8_0_linear,
                     **dict.fromkeys(Q4_METHODS, q4_linear)}


def quantize_weight(weight: torch.Tensor, method: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, scales) of `weight` [N, K] as `QUANTIZED_MATMULS[method]` takes them: int8 rows with
    float32 scales (w8a8) or scales in the kernel's dtype (int8); int8 rows with a float32 scale per
    block of 32 (q8_0); packed 4-bit groups with their scales and zero points (int4); packed 4-bit
    steps with a scale and low per 32 (q4_0). q4_1 and q4_k hold a file's blocks only."""
    if method == "int4":
        return quantize_int4(weight)
    if method == "q4_0":
        return quantize_q4_0(weight)
    if method == "q8_0":
        return quantize_per_block(weight)
    rows, scales = quantize_per_channel(weight)
    return rows, scales if method == "w8a8" else scales.to(kernel_dtype(weight.dtype))
