"""Comparing with transformers: tiny checkpoints it saves, its greedy tokens, and our decoder's logits over
one sequence in a fresh paged cache (64 slots)."""

from __future__ import annotations

import torch

from engine.models.attention import SequenceChunk, build_metadata
from engine.models.tiny import write_tokenizer


def save_hf_checkpoint(tmp_path_factory, name: str, config_cls, model_cls, options: dict, seed: int = 0,
                       redraw: tuple[str, ...] = (), redraw_std: float = 0.5):
    """A random model of transformers' `model_cls`, saved (with a tokenizer) as checkpoint `name`;
    returns (its directory, the model). Parameters whose names end with one of `redraw` (biases and
    sinks, which transformers starts at zero or near it; buffers too) are drawn again, wide enough to matter."""
    torch.manual_seed(seed)
    model = model_cls(config_cls(**options)).eval()
    with torch.no_grad():
        for param_name, param in [*model.named_parameters(), *model.named_buffers()]:
            if param_name.endswith(redraw):
                param.normal_(0.0, redraw_std)
    path = tmp_path_factory.mktemp(name)
    model.save_pretrained(path)
    write_tokenizer(path, options["vocab_size"])
    return path, model


def transformers_greedy(model, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, one prompt at a time."""
    out = []
    with torch.no_grad():
        for prompt in prompts:
            mask = torch.ones(1, len(prompt), dtype=torch.long)
            generated = model.generate(torch.tensor([prompt]), attention_mask=mask, max_new_tokens=max_tokens,
                                       do_sample=False)
            out.append(generated[0, len(prompt):].tolist())
    return out


def paged_logits(model, inputs: torch.Tensor | list[int], chunks: list[tuple[int, int]], block_table: list[int],
                 block_size: int = 4) -> torch.Tensor:
    """Our logits [T, V] over `inputs` (token ids, or input embeddings [T, H]), run in the
    (start, end) `chunks` over a paged KV cache read through `block_table`; each KV cache group of
    a hybrid model gets the table shifted onto blocks of its own, as the scheduler would give it."""
    num_blocks, groups = len(block_table), model.kv_layout.num_groups
    keys, values = model.kv_cache_shapes(groups * num_blocks * block_size)
    kv = [(torch.zeros(keys), torch.zeros(values)) for _ in range(model.num_kv_caches)]
    tables = [[b + g * num_blocks for b in block_table] for g in range(groups)]
    inputs = torch.as_tensor(inputs)
    out = []
    with torch.no_grad():
        for start, end in chunks:
            per_group = [[SequenceChunk(start, end - start, table)] for table in tables]
            meta = build_metadata(per_group[0], block_size, torch.device("cpu"), other_kv_groups=per_group[1:])
            rows = model.embed(inputs[start:end]) if inputs.dim() == 1 else inputs[start:end]
            out.append(model.compute_logits(model(rows, torch.arange(start, end), kv, meta)))
    return torch.cat(out)


def decoder_logits(decoder, hidden: torch.Tensor) -> torch.Tensor:
    """Logits [T, V] of `decoder` for input embeddings `hidden` [T, H] at positions 0..T-1."""
    return paged_logits(decoder, hidden, [(0, hidden.shape[0])], list(range(4)), 16)


def decided_prefix(model, prompt: list[int], tokens: list[int], margin: float) -> int:
    """How many of `tokens` (`model`'s own greedy continuation of `prompt`) it chose by more than
    `margin` (a fraction of the largest logit at that position) between its top two logits,
    counted up to the first near tie. Past a near tie, a reduced dtype's rounding (any
    implementation's) may pick either token, and the sequences part."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float()
    top2 = logits.topk(2, dim=-1).values
    ties = ((top2[:, 0] - top2[:, 1]) <= margin * logits.abs().amax(-1)).nonzero()
    return int(ties[0]) if len(ties) else len(tokens)


def decode_package_code(graphs) -> str:
    """The C++ of the decode package `graphs` (a `DecodeGraphs`) saved, after checking that our
    GIL-free runner can load it (no extern kernels beside its library, so no proxy executor): what
    a test reads to see which of our kernels' C shims the package calls."""
    import zipfile

    from engine.worker import aoti_runner, precompiled_graph
    from engine.worker.decode_graphs import TRACE_ROWS

    package = precompiled_graph.artefact_path(graphs.cache_dir, graphs.model, graphs.kv_caches, graphs.block_size,
                                              TRACE_ROWS)
    with zipfile.ZipFile(package) as archive:
        names = archive.namelist()
        (wrapper,) = (name for name in names if name.endswith(".wrapper.cpp"))
        code = archive.read(wrapper).decode()
    assert aoti_runner._library_member(names) is not None
    return code

