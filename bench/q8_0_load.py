"""`python -m bench.q8_0_load FILE.gguf`: loading a Q8_0 GGUF file with our one-pass q8_0 quantizer
(engine/kernels/q8_0_quantize.c) against torch's ops (`quantize_per_block_in_torch`), in one process.

Per round, alternating which goes first: `quantize_per_block` on a random float32 weight of the
file's LM head shape, then `load_decoder(FILE)` (which reads the file's blocks as floats and
quantizes them again). Printed: each side's median and its rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable
from unittest import mock

import torch

from engine.kernels import q8_0_quantize
from engine.models import gguf_file
from engine.models.loader import load_decoder
from engine.models.quantized_linear import quantize_per_block


def _timed(run: Callable[[], object]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = gguf_file.gguf_config(args.gguf)
    head = torch.randn(config["vocab_size"], config["hidden_size"])
    times: dict[str, list[tuple[float, float]]] = {"ours": [], "torch's ops": []}
    for index in range(args.rounds):
        for side in (list(times) if index % 2 == 0 else list(reversed(times))):
            torch_ops = mock.patch.object(q8_0_quantize, "quantize", lambda weight, threads: None)
            with contextlib.nullcontext() if side == "ours" else torch_ops:
                times[side].append((_timed(lambda: quantize_per_block(head)), _timed(lambda: load_decoder(args.gguf))))
    print(f"{args.gguf}: {args.threads} torch threads, {args.rounds} rounds alternating; "
          f"head {tuple(head.shape)} float32")
    for side, rounds in times.items():
        print(f"{side}: head quantized in {statistics.median(h for h, _ in rounds):.3f} s, load_decoder "
              f"{statistics.median(load for _, load in rounds):.2f} s (rounds: "
              f"{', '.join(f'{load:.2f}' for _, load in rounds)})")


if __name__ == "__main__":
    main()
