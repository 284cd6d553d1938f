"""`python -m bench.gil_release`: how fast a Python thread runs while another thread runs a
packaged graph, through torch's loader and through ours (engine/worker/aoti_runner.py).

The engine's event loop is such a Python thread, and a compiled decode step such a graph. The
graph here is a small MLP (two 1024-wide linears over 64 rows, one torch thread) packaged by
AOTInductor once; then, rounds alternating which loader goes first, a thread counts Python loop
iterations for `--seconds` alone and beside each loader running the graph back to back. Printed:
each side's median rate as a fraction of the rate alone (1.0: the loop lost nothing).
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.rounds import alternating, median_and_rounds
from engine.worker import aoti_runner


class _Mlp(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = torch.nn.Linear(width, width)
        self.down = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down(torch.relu(self.up(x)))
        return out


def _loop_rate(seconds: float) -> float:
    count, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        count += 1
    return count / seconds


def _rate_beside(run: Callable[[], object], seconds: float) -> float:
    stop = threading.Event()

    def busy() -> None:
        while not stop.is_set():
            run()

    thread = threading.Thread(target=busy)
    thread.start()
    try:
        return _loop_rate(seconds)
    finally:
        stop.set()
        thread.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=1.0, help="each measurement's length")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, x = _Mlp(1024).eval(), torch.randn(64, 1024)
    with tempfile.TemporaryDirectory() as scratch, torch.inference_mode():
        package = Path(scratch) / "mlp.pt2"
        program = torch.export.export(model, (x,))
        torch._inductor.aoti_compile_and_package(program, package_path=str(package),
                                                 inductor_configs={"aot_inductor.package_constants_in_so": False})
        constants = {name: t for name, t in model.state_dict().items()}
        torchs = torch._C._aoti.AOTIModelPackageLoader(str(package), "model", False, 1, -1)
        torchs.load_constants({name: constants[name] for name in torchs.get_constant_fqns()}, False, True, True)
        ours = aoti_runner.load(package, constants)
        assert ours is not None
        assert torch.equal(ours.run([x])[0], torchs.run([x])[0])
        sides: dict[str, Callable[[], object]] = {"torch's loader": lambda: torchs.run([x]),
                                                  "ours (ctypes)": lambda: ours.run([x])}
        def fraction(run: Callable[[], object]) -> Callable[[], float]:
            def measure() -> float:
                alone = _loop_rate(args.seconds)
                return _rate_beside(run, args.seconds) / alone
            return measure

        fractions = alternating({name: fraction(run) for name, run in sides.items()}, args.rounds)
    print(f"graph: 2 x Linear(1024, 1024) over 64 rows, float32, 1 torch thread; {args.rounds} rounds alternating, "
          f"{args.seconds} s each")
    for name, values in fractions.items():
        median, rounds = median_and_rounds(values, ".2f")
        print(f"{name}: a Python loop beside the graph ran at {median}x its rate alone (rounds: {rounds})")


if __name__ == "__main__":
    main()
