"""`trio-llm bench sliding-window`: the KV cache one long sequence holds on a model with sliding
layers, against the same model with full attention on every layer: the same sizes, weights, dtype,
prompt and engine settings, the layers' windows the only difference.

`--arch mistral`: every layer slides (one block table whose blocks behind the window are released).
`--arch gemma3` (five sliding layers to a global one, Gemma 3 270M's 18 layers) and `--arch gpt_oss`
(alternating): the hybrid layout of engine/kv_groups.py, a table per group. A block there holds one
layer of each group's share, so blocks are not the same size on both sides: the KV cache bytes held
are printed beside the block counts. The most blocks the sequence held while it generated is read
from the engine's own KV usage after each token, and the decode rate is printed beside it."""

from __future__ import annotations

import json
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from engine import EngineConfig, open_engine
from engine.kv_groups import KVLayout
from engine.models.tiny import make_model
from engine.models.tiny_spec import TinyModelSpec
from engine.sampling_params import RequestOutputKind, SamplingParams

LAYERS = {"mistral": 4, "gemma3": 18, "gpt_oss": 24}


@dataclass
class Held:
    name: str
    blocks: int  # the most blocks the sequence held
    layers_per_block: int
    block_bytes: int
    decode_rate: float

    @property
    def mib(self) -> float:
        return self.blocks * self.block_bytes / 2**20


async def held_blocks(name: str, model: str, prompt: list[int], output_len: int, block_size: int,
                      num_blocks: int) -> Held:
    config = EngineConfig(model=model, dtype="float32", block_size=block_size, num_kv_blocks=num_blocks,
                          enforce_eager=True, max_model_len=len(prompt) + output_len)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    most, started, tokens = 0, None, 0
    async with open_engine(config) as engine:
        async for _ in engine.generate(prompt, params, "long"):
            most = max(most, round(engine.stats().kv_cache_usage * num_blocks))
            tokens += 1
            started = started or time.perf_counter()
        seconds = time.perf_counter() - (started or time.perf_counter())
        block_bytes = engine.info.kv_bytes_per_block
    raw = json.loads((Path(model) / "config.json").read_text())
    window = raw.get("sliding_window")
    types = raw.get("layer_types") or ["sliding_attention" if window else "full_attention"] * raw["num_hidden_layers"]
    layout = KVLayout.of([window if kind == "sliding_attention" else None for kind in types])
    return Held(name, most, layout.group_size, block_bytes, (tokens - 1) / seconds if seconds > 0 else 0.0)


def _full_attention_copy(path: Path, into: Path) -> Path:
    """The checkpoint with every layer attending to everything (config.json edited, weights shared)."""
    into.mkdir()
    for item in path.iterdir():
        (into / item.name).symlink_to(item)
    raw = json.loads((path / "config.json").read_text())
    if "layer_types" in raw:
        raw["layer_types"] = ["full_attention"] * len(raw["layer_types"])
    else:
        raw["sliding_window"] = None
    (into / "config.json").unlink()
    (into / "config.json").write_text(json.dumps(raw))
    return into


async def run(arch: str, length: int, window: int, block_size: int, prompt_len: int) -> str:
    spec = TinyModelSpec(arch=arch, layers=LAYERS[arch], hidden=256, heads=4, kv_heads=2, intermediate=768,
                         vocab=4096, max_positions=length, sliding_window=window, experts=4)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        sliding = make_model(Path(tmp) / "sliding", spec)
        models = {"sliding layers": sliding, "full attention": _full_attention_copy(sliding, Path(tmp) / "full")}
        prompt = random.Random(0).choices(range(3, spec.vocab), k=prompt_len)
        for name, path in models.items():
            num_blocks = 2 * LAYERS[arch] * (-(-length // block_size) + 1)  # room for any layout
            rows.append(await held_blocks(name, str(path), prompt, length - prompt_len, block_size, num_blocks))
    head = (f"one sequence of {length} tokens ({prompt_len} prompt, {length - prompt_len} generated), {arch} shape "
            f"layers={LAYERS[arch]} hidden=256 window={window}, float32, eager, block_size={block_size}, the same "
            f"weights both sides")
    lines = [head, f"{'model':<16}{'most KV blocks held':>20}{'layers a block':>15}{'KV MiB held':>13}"
                   f"{'decode tok/s':>14}"]
    lines += [f"{r.name:<16}{r.blocks:>20}{r.layers_per_block:>15}{r.mib:>13.2f}{r.decode_rate:>14.1f}" for r in rows]
    lines.append(f"ratio (full / sliding): {rows[1].mib / max(rows[0].mib, 1e-9):.1f}x the KV cache bytes")
    return "\n".join(lines)
