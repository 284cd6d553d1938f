"""An AOTInductor package's model run through its library's C interface with ctypes: the GIL is
released while the graph computes.

torch's loader (`torch._C._aoti.AOTIModelPackageLoader.run`) holds the GIL for the whole run, so
while a compiled step computes no other Python thread of the process runs: the engine's event loop
(scheduling, detokenizing, sending the last step's tokens) waits for the graph, and the two
serialise. Measured on a 2-core machine (`python -m bench.gil_release`): a Python loop beside a
thread running a packaged graph ran at 0.01x its speed alone through torch's loader, 0.93x through
this runner. ctypes releases the GIL for a foreign call, as torch's eager kernels release it for
theirs.

The library's C interface (torch/csrc/inductor/aoti_runtime/interface.h) is what torch's loader
calls itself: create a container, hand it the model's tensors as user-managed constants (by
reference, as `precompiled_graph.saved` does through the loader), run. Tensors cross as
`AtenTensorHandle`s made and taken back by torch's own helpers (`torch._C._aoti`). A package whose
graph calls operators outside itself (a JSON file of extern kernels beside the library: the step
graph's attention op) needs torch's proxy executor, a C++ object this interface cannot build:
`load` returns None for it and the caller keeps torch's loader.

Where the loop is meant to wait for the step, holding the GIL is the better choice: the engine
process binds its loop to the compute CPUs so that it runs between forward passes, and with the
GIL free it preempted the compute thread mid-step instead (served small Llama Q8_0 at 16 streams,
twelve alternating loads a side: 990 tok/s with ours against 1,117 with torch's loader). That
process calls `hold_the_gil_during_steps` when its loop shares the compute CPUs (bound to them,
or a machine of one CPU); a library user's process, whose event loop must keep serving while a
step computes, keeps ours.
"""

from __future__ import annotations

import ctypes
import os
import tempfile
import weakref
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_new_capsule = ctypes.pythonapi.PyCapsule_New
_new_capsule.restype = ctypes.py_object
_new_capsule.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


class _ConstantEntry(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("handle", ctypes.c_void_p)]


def _handles(tensors: Sequence[torch.Tensor]) -> list[int]:
    """New `AtenTensorHandle`s referencing `tensors` (each owns one reference until freed or stolen)."""
    return [_capsule_pointer(c, None) for c in torch._C._aoti.unsafe_alloc_void_ptrs_from_tensors(list(tensors))]


def _take(handles: Sequence[int]) -> list[torch.Tensor]:
    """The tensors of `handles`, which are freed with them."""
    return torch._C._aoti.alloc_tensors_by_stealing_from_void_ptrs([_new_capsule(h, None, None) for h in handles])


def _library_member(names: Sequence[str]) -> str | None:
    """The package's one model library, or None when it is not one this runner can run alone
    (none, several, or extern kernels beside it)."""
    libraries = [n for n in names if n.endswith(".so") and "/data/aotinductor/" in n]
    extern_kernels = [n for n in names if "/data/aotinductor/" in n and n.endswith(".json")
                      and not n.endswith("_metadata.json")]
    return libraries[0] if len(libraries) == 1 and not extern_kernels else None


class GilFreeModel:
    """A packaged graph, created over `constants` (the model's tensors by original name, held by
    reference: the caller keeps them alive and unchanged in shape) on the CPU. When it is
    collected, its container and its references to the tensors go; the library stays mapped
    (ctypes never unloads one: a few MB per package loaded, in tests that load many)."""

    def __init__(self, library: ctypes.CDLL, constants: Mapping[str, torch.Tensor]) -> None:
        self._lib = library
        self._run = library.AOTInductorModelContainerRun
        self._container = ctypes.c_void_p()
        self._check("CreateWithDevice", library.AOTInductorModelContainerCreateWithDevice(
            ctypes.byref(self._container), 1, b"cpu", None))
        self._constant_handles: list[int] = []
        # weakref.finalize, not __del__: the container goes before the handles it borrows.
        weakref.finalize(self, _release, library, self._container, self._constant_handles)
        self.num_outputs = self._count("GetNumOutputs")
        entries = self._constant_entries(constants)
        pairs = (_ConstantEntry * len(entries))(*entries)
        # user-managed: the container reads the tensors in place; validate: every constant given.
        self._check("UpdateUserManagedConstantBufferPairs",
                    library.AOTInductorModelContainerUpdateUserManagedConstantBufferPairs(
                        self._container, pairs, len(entries), False, True))

    def run(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The graph's outputs for `inputs` (in the exported order). Blocks without the GIL."""
        handles = (ctypes.c_void_p * len(inputs))(*_handles(inputs))  # stolen by the run
        outputs = (ctypes.c_void_p * self.num_outputs)()
        self._check("Run", self._run(self._container, handles, len(inputs), outputs, self.num_outputs, None, None))
        return _take(list(outputs))

    def _constant_entries(self, constants: Mapping[str, torch.Tensor]) -> list[_ConstantEntry]:
        names, tensors = [], []
        for index in range(self._count("GetNumConstants")):
            folded = ctypes.c_bool()
            self._check("GetConstantFromFolded", self._lib.AOTInductorModelContainerGetConstantFromFolded(
                self._container, index, ctypes.byref(folded)))
            if folded.value:
                continue
            names.append(self._string("GetConstantName", index))
            fqn = self._string("GetConstantOriginalFQN", index).decode()
            if fqn not in constants:
                raise KeyError(f"the package's constant {fqn!r} is not a tensor of the model")
            tensors.append(constants[fqn])
        self._constant_handles.extend(_handles(tensors))
        return [_ConstantEntry(name, handle) for name, handle in zip(names, self._constant_handles, strict=True)]

    def _count(self, what: str) -> int:
        value = ctypes.c_size_t()
        self._check(what, getattr(self._lib, f"AOTInductorModelContainer{what}")(self._container,
                                                                                 ctypes.byref(value)))
        return value.value

    def _string(self, what: str, index: int) -> bytes:
        value = ctypes.c_char_p()
        self._check(what, getattr(self._lib, f"AOTInductorModelContainer{what}")(self._container, index,
                                                                                 ctypes.byref(value)))
        assert value.value is not None
        return value.value

    @staticmethod
    def _check(what: str, error: int) -> None:
        if error != 0:
            raise RuntimeError(f"AOTInductorModelContainer{what} failed (error {error}; the library logs why)")


def _release(library: ctypes.CDLL, container: ctypes.c_void_p, constant_handles: list[int]) -> None:
    if container.value:
        library.AOTInductorModelContainerDelete(container)
    _take(constant_handles)  # the references to the model's tensors, dropped


_releasing = True  # whether this process runs packages with our runner (`releases_the_gil`)


def hold_the_gil_during_steps() -> None:
    """From now on this process runs packaged graphs on torch's loader, which holds the GIL while
    a graph runs: for a process whose event loop is bound to the compute CPUs and should wait for
    each step."""
    global _releasing
    _releasing = False


def releases_the_gil() -> bool:
    """Whether this process runs packaged graphs with our runner (no `hold_the_gil_during_steps`)."""
    return _releasing


def load(path: Path, constants: Mapping[str, torch.Tensor]) -> GilFreeModel | None:
    """The package at `path` as a `GilFreeModel` over `constants`; None when it calls extern
    kernels (keep torch's loader). Raises on an unreadable package or a missing constant."""
    with zipfile.ZipFile(path) as package:
        member = _library_member(package.namelist())
        if member is None:
            return None
        fd, library_file = tempfile.mkstemp(prefix="trio-llm-aoti-", suffix=".so")
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(package.read(member))
            library: Any = ctypes.CDLL(library_file)
        finally:
            os.unlink(library_file)  # a loaded library needs no file
    return GilFreeModel(library, constants)
