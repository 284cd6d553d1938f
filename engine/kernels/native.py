"""Build a C kernel of ours for this machine on first use, cache it, load it with ctypes.

A kernel is one C file beside this module, with no dependency but the C library and the headers
beside it (`split_threads.h`: work split over threads), which are part of every kernel's build key. It is built with
the system's C compiler (`$CC`, else `cc`: the one inductor's compiled graphs need too) for this
CPU (`-march=native`) into `~/.cache/trio-llm/kernels/` (`engine.paths.cache_root`), under a name
that hashes the source, the compiler's version, the flags and the CPU's features: a changed file,
compiler or machine builds afresh (the `KEEP_BUILDS` most recently used builds of a kernel are
kept), and everything else loads in a millisecond. Building takes about half a second; it happens
at most once per machine and version, in whichever process first asks (a decoder's worker asks at
load time, so no request waits for it; see `engine.worker.worker.Worker._load_model`). Two
processes building at once each write a file of their own and rename it into place, so neither
reads a half-written library.

Without a compiler, or if the build fails, `load` returns None and logs why once: the callers
keep torch's kernels. ctypes calls release the GIL, as torch's own kernels do.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine.paths import cache_root

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent
KEEP_BUILDS = 4
FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fno-math-errno", "-pthread", "-shared", "-fPIC")
# Kernels that are also operators of compiled graphs: they call torch's C shim and run on torch's
# OpenMP team (the one inductor's loops use, so no second pool of spinning threads), so they link
# torch's own libraries, which the process has loaded already.
TORCH_LINKED = frozenset({"q8_0_rows", "q4_rows", "paged_decode"})


def _link_flags(stem: str) -> tuple[str, ...]:
    """What a `TORCH_LINKED` kernel's build adds: torch's libraries, and torch's version (a macro
    the source does not read: it puts the version in the build key, for the shim's ABI)."""
    if stem not in TORCH_LINKED:
        return ()
    import torch

    lib = Path(torch.__file__).parent / "lib"
    return ("-fopenmp", f"-DTRIO_LLM_TORCH_VERSION={torch.__version__}", f"-L{lib}", f"-Wl,-rpath,{lib}",
            "-l:libgomp.so.1", "-ltorch_cpu")


@functools.cache
def load(name: str) -> ctypes.CDLL | None:
    """The built kernel library `name` (`engine/kernels/<name>.c`), or None if it cannot be built
    here (the reason logged once). Blocks while it builds: call it from a worker thread or at
    start-up, not from an event loop."""
    source = SOURCE_DIR / f"{name}.c"
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        logger.warning("no C compiler (%s) to build the %s kernel: torch's kernels run instead",
                       os.environ.get("CC", "cc"), name)
        return None
    try:
        library = _built(source, compiler)
        # Global symbols: a compiled graph's package calls a graph operator's C shim by name.
        return ctypes.CDLL(str(library), mode=ctypes.RTLD_GLOBAL)
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = exc.stderr if isinstance(exc, subprocess.CalledProcessError) else exc
        logger.warning("could not build the %s kernel (torch's kernels run instead): %s", name, detail)
        return None


def load_graph_operators() -> None:
    """Load (building if need be) every kernel whose C shims compiled graphs call by name
    (`TORCH_LINKED`), with its symbols global: call before loading a package, whose library is
    refused by the dynamic loader while a name it calls is undefined."""
    for name in sorted(TORCH_LINKED):
        load(name)


@functools.cache
def int_function(name: str, symbol: str, argtypes: tuple[Any, ...]) -> Callable[..., int] | None:
    """Function `symbol` of kernel `name` (built on first use, as `load`), taking `argtypes` and
    returning a C int (0: done); None if the kernel cannot be built here."""
    library = load(name)
    if library is None:
        return None
    function = getattr(library, symbol)
    function.argtypes = argtypes
    function.restype = ctypes.c_int
    kernel: Callable[..., int] = function
    return kernel


def library_path(source: Path, compiler: str) -> Path:
    """Where `source` built by `compiler` for this machine lives in the cache."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256()
    headers = b"".join(header.read_bytes() for header in sorted(SOURCE_DIR.glob("*.h")))  # what sources include
    flags = " ".join(FLAGS + _link_flags(source.stem))
    for part in (source.read_bytes(), headers, version.encode(), flags.encode(), _cpu_features().encode()):
        key.update(part)
        key.update(b"\0")
    return cache_root() / "kernels" / f"{source.stem}-{key.hexdigest()[:16]}.so"


def _built(source: Path, compiler: str) -> Path:
    target = library_path(source, compiler)
    if target.exists():
        os.utime(target)  # most recently used: what `_prune` keeps
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=target.parent, prefix=f".{target.stem}-", suffix=".so")
    os.close(fd)
    try:
        command = [compiler, *FLAGS, "-o", partial, str(source), *_link_flags(source.stem)]
        subprocess.run(command, capture_output=True, text=True, check=True)
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    logger.info("built the %s kernel for this machine: %s", source.stem, target)
    _prune(target.parent, source.stem)
    return target


def _prune(directory: Path, stem: str) -> None:
    """Keep the `KEEP_BUILDS` most recently used builds of kernel `stem` (other versions of the
    source, compilers or machines sharing the cache); a process that still has one loaded keeps
    its mapping."""
    builds = sorted(directory.glob(f"{stem}-*.so"), key=lambda p: p.stat().st_mtime, reverse=True)
    for stale in builds[KEEP_BUILDS:]:
        stale.unlink(missing_ok=True)


def _cpu_features() -> str:
    """What -march=native builds for: the CPU's model and feature flags."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            lines = [line for line in cpuinfo if line.startswith(("flags", "model name", "Features", "CPU part"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.machine() + platform.processor()
