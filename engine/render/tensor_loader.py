"""Read one tensor saved with `torch.save`, safely, without holding the GIL for long.

`torch.load(io.BytesIO(raw), weights_only=True)` is safe but copies every
storage through a Python file object with the GIL held: ~13 ms for a 16 MiB
payload, during which no other thread (the event loop included) runs. This
reader parses the same format with the work split differently:

- the zip directory and the small `data.pkl` pickle are parsed in Python
  (microseconds);
- the pickle goes through an allowlist unpickler: only the handful of
  globals a saved tensor uses resolve, each to a function of ours that
  rebuilds the tensor (never to torch's own rebuild helpers), so a pickle
  that names anything else (`os.system`, `builtins.eval`, ...) is refused
  before anything runs, as `weights_only=True` would refuse it;
- storages are zero-copy views (`torch.frombuffer`) on the payload buffer,
  bounds-checked against the archive entry; the tensor keeps the buffer
  alive. Any copy that remains (a dtype cast, densifying) is a torch op,
  which releases the GIL.

Sparse COO tensors are rebuilt with `check_invariants=True` on the call
itself, so index bounds are checked without the process-wide
`torch.sparse.check_sparse_tensor_invariants` switch, which is not safe when
several threads decode at once.

Every malformed input raises `TensorPayloadError` with a reason.
"""

from __future__ import annotations

import io
import pickle
import struct
import zipfile
from collections import OrderedDict
from typing import Any

import torch
from typing_extensions import Buffer

MAX_PICKLE_BYTES = 1 << 20  # a tensor's data.pkl is a few hundred bytes

_STORAGE_DTYPES = {
    "FloatStorage": torch.float32, "DoubleStorage": torch.float64, "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
    "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool,
}
_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, then file name and extra field lengths
_SPARSE_COO = "sparse_coo"


class TensorPayloadError(ValueError):
    """The bytes are not a single tensor in `torch.save` format, or not a safe one."""


def load_tensor(raw: bytearray | bytes) -> torch.Tensor:
    """The tensor `torch.save` wrote into `raw`, as views on `raw`'s memory.

    Pass a `bytearray` (`pybase64.b64decode_as_bytearray` makes one): `bytes`
    are read-only, and a tensor must not alias read-only memory, so they are
    copied first.
    """
    if not isinstance(raw, bytearray):
        raw = bytearray(raw)
    archive = _Archive(raw)
    try:
        result = _TensorUnpickler(io.BytesIO(archive.pickle_bytes()), archive).load()
    except TensorPayloadError:
        raise
    except Exception as exc:  # a malformed pickle fails in many ways; none of them runs code of its own
        if is_out_of_memory(exc):
            raise
        raise TensorPayloadError(f"malformed payload ({type(exc).__name__}: {exc})") from None
    if not isinstance(result, torch.Tensor):
        raise TensorPayloadError(f"the payload holds a {type(result).__name__}, not a tensor")
    return result


class _Archive:
    """The zip archive `torch.save` writes: `<name>/data.pkl` plus one entry per storage."""

    def __init__(self, raw: bytearray) -> None:
        self.raw = raw
        try:
            self.zip = zipfile.ZipFile(_BufferReader(raw))
            names = self.zip.namelist()
        except (zipfile.BadZipFile, OSError, ValueError, EOFError) as exc:
            raise TensorPayloadError("not a torch.save archive (the legacy non-zip format is not accepted)") \
                from exc
        pickles = [n for n in names if n.endswith("/data.pkl") and n.count("/") == 1]
        if len(pickles) != 1:
            raise TensorPayloadError("not a torch.save archive: no single data.pkl")
        self.prefix = pickles[0][: -len("data.pkl")]
        byteorder = self.prefix + "byteorder"
        if byteorder in names and self.zip.read(byteorder) != b"little":
            raise TensorPayloadError("only little-endian payloads are accepted")

    def pickle_bytes(self) -> bytes:
        info = self.zip.getinfo(self.prefix + "data.pkl")
        if info.file_size > MAX_PICKLE_BYTES:
            raise TensorPayloadError("data.pkl is too large for a single tensor")
        return self.zip.read(info)

    def storage(self, key: str, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """A flat, zero-copy view of storage `key`, checked to hold exactly `numel` elements."""
        try:
            info = self.zip.getinfo(f"{self.prefix}data/{key}")
        except KeyError:
            raise TensorPayloadError(f"storage {key!r} is missing from the archive") from None
        if info.compress_type != zipfile.ZIP_STORED:
            raise TensorPayloadError("compressed storages are not accepted")
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if info.file_size != nbytes:
            raise TensorPayloadError(f"storage {key!r} holds {info.file_size} bytes, expected {nbytes}")
        if nbytes == 0:
            return torch.empty(0, dtype=dtype)
        header = self.raw[info.header_offset:info.header_offset + _LOCAL_HEADER.size]
        if len(header) != _LOCAL_HEADER.size:
            raise TensorPayloadError("truncated archive")
        signature, name_len, extra_len = _LOCAL_HEADER.unpack(header)
        start = info.header_offset + _LOCAL_HEADER.size + name_len + extra_len
        if signature != b"PK\x03\x04" or start + nbytes > len(self.raw):
            raise TensorPayloadError("truncated or corrupt archive")
        view = memoryview(self.raw)[start:start + nbytes]
        return torch.frombuffer(view, dtype=dtype)


class _BufferReader(io.RawIOBase):
    """A seekable read-only file over a buffer, without copying it (`io.BytesIO` copies a
    bytearray, 16 MiB with the GIL held). zipfile only reads the small directory through it."""

    def __init__(self, buffer: bytearray) -> None:
        self._view = memoryview(buffer)
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, buffer: Buffer) -> int:
        target = memoryview(buffer).cast("B")
        chunk = self._view[self._pos:self._pos + len(target)]
        target[:len(chunk)] = chunk
        self._pos += len(chunk)
        return len(chunk)


class _StorageType:
    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype


class _TensorUnpickler(pickle.Unpickler):
    """Resolves only the globals a saved tensor uses, each to our own rebuild function."""

    def __init__(self, file: io.BytesIO, archive: _Archive) -> None:
        super().__init__(file)
        self.archive = archive

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and name in _STORAGE_DTYPES:
            return _StorageType(_STORAGE_DTYPES[name])
        allowed = _ALLOWED_GLOBALS.get((module, name))
        if allowed is None:
            raise TensorPayloadError(f"the payload refers to {module}.{name}, which a tensor payload may not")
        return allowed

    def persistent_load(self, pid: Any) -> torch.Tensor:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                and isinstance(pid[1], _StorageType) and isinstance(pid[2], str) and _is_count(pid[4])):
            raise TensorPayloadError("malformed storage reference")
        _, storage_type, key, _location, numel = pid
        return self.archive.storage(key, storage_type.dtype, numel)


def is_out_of_memory(exc: BaseException) -> bool:
    """Out of memory is the server's problem, never the payload's: callers re-raise it.
    torch reports a failed CPU allocation as a plain RuntimeError."""
    if isinstance(exc, (MemoryError, torch.OutOfMemoryError)):
        return True
    return isinstance(exc, RuntimeError) and ("can't allocate memory" in str(exc) or "out of memory" in str(exc))


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _rebuild_dense(storage: Any, offset: Any, size: Any, stride: Any, *_ignored: Any) -> torch.Tensor:
    if not isinstance(storage, torch.Tensor):
        raise TensorPayloadError("malformed tensor record")
    size, stride = tuple(size), tuple(stride)
    if (len(size) != len(stride) or not _is_count(offset)
            or not all(_is_count(v) for v in size + stride)):
        raise TensorPayloadError("malformed tensor shape, stride or offset")
    if all(size):  # the furthest element must lie inside the storage
        last = offset + sum((n - 1) * s for n, s in zip(size, stride, strict=True))
        if last >= storage.numel():
            raise TensorPayloadError("the tensor's shape and strides reach outside its storage")
    return storage.as_strided(size, stride, offset)


def _rebuild_sparse(layout: Any, data: Any) -> torch.Tensor:
    if layout != _SPARSE_COO:
        raise TensorPayloadError(f"sparse layout {layout!r} is not accepted (only sparse COO)")
    if not (isinstance(data, tuple) and len(data) in (3, 4)):
        raise TensorPayloadError("malformed sparse tensor record")
    indices, values, size = data[:3]
    if not (isinstance(indices, torch.Tensor) and isinstance(values, torch.Tensor)):
        raise TensorPayloadError("malformed sparse tensor record")
    if not all(_is_count(v) for v in tuple(size)):
        raise TensorPayloadError("malformed sparse tensor size")
    try:
        return torch.sparse_coo_tensor(indices, values, tuple(size), check_invariants=True)
    except (RuntimeError, ValueError, TypeError) as exc:
        if is_out_of_memory(exc):
            raise
        raise TensorPayloadError(f"invalid sparse tensor: {exc}") from None


def _get_layout(name: Any) -> str:
    if name != "torch.sparse_coo":
        raise TensorPayloadError(f"layout {name!r} is not accepted")
    return _SPARSE_COO


def _size(dims: Any = ()) -> tuple[int, ...]:
    return tuple(dims)


_ALLOWED_GLOBALS = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_dense,
    ("torch._utils", "_rebuild_sparse_tensor"): _rebuild_sparse,
    ("torch.serialization", "_get_layout"): _get_layout,
    ("torch", "Size"): _size,
    ("collections", "OrderedDict"): OrderedDict,
}
