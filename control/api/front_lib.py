"""`libswitchyard_front.so`, the native gRPC front (runtime_cpp/src/front/), through
ctypes: a C library, so one build serves whatever Python runs the control plane.

The build installs it in the `switchyard` package, under `_native/`;
`SWITCHYARD_FRONT_LIB` names another file (a build tree, a copy on another machine).
Each call releases the GIL while it runs.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import switchyard
from switchyard_common.ports import port_in_use

LIB_ENV = "SWITCHYARD_FRONT_LIB"
LIB_NAME = "libswitchyard_front.so"
_ERROR_BYTES = 512


class FrontUnavailable(RuntimeError):
    """The library is not there (a build without the C++ parts) or does not load."""


def find_library() -> Path:
    named = os.environ.get(LIB_ENV)
    if named:
        return Path(named)
    for root in switchyard.__path__:
        path = Path(root) / "_native" / LIB_NAME
        if path.exists():
            return path
    raise FrontUnavailable(
        f"{LIB_NAME} is not installed (a build with SWITCHYARD_BUILD_CPP=OFF has no native "
        f"front; set {LIB_ENV} to its path, or api.front: python)"
    )


_lib: ctypes.CDLL | None = None


def unavailable() -> str | None:
    """Why the native front cannot serve here (the library is missing or does not load);
    None when it can."""
    try:
        _load()
    except FrontUnavailable as e:
        return str(e)
    return None


def _load() -> ctypes.CDLL:
    global _lib
    if _lib is not None:
        return _lib
    path = find_library()
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        raise FrontUnavailable(f"cannot load the native front {path}: {e}") from e
    vp, cp, sz = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t
    lib.sy_front_start.restype = vp
    ci = ctypes.c_int
    lib.sy_front_start.argtypes = [cp, ci, ci, ci, cp, cp, cp, cp, sz]
    lib.sy_front_port.argtypes = [vp]
    lib.sy_front_event_fd.argtypes = [vp]
    lib.sy_front_open_calls.restype = ctypes.c_long
    lib.sy_front_open_calls.argtypes = [vp]
    lib.sy_front_poll.argtypes = [vp, ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(sz)]
    lib.sy_front_free.argtypes = [vp]
    lib.sy_front_apply.restype = None
    lib.sy_front_apply.argtypes = [vp, cp, sz]
    lib.sy_front_bad_batches.restype = ctypes.c_ulonglong
    lib.sy_front_bad_batches.argtypes = [vp]
    u64 = ctypes.c_ulonglong
    data_out, size_out = ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(sz)
    lib.sy_front_vocab.argtypes = [vp, cp, sz]
    lib.sy_front_direct_start.argtypes = [vp, u64, u64, u64, ci, cp, sz, ctypes.c_double]
    lib.sy_front_direct_stop.argtypes = [vp, u64, u64, data_out, size_out]
    lib.sy_front_feed.argtypes = [vp, u64, cp, sz, data_out, size_out]
    lib.sy_front_shutdown.argtypes = [vp, ctypes.c_double]
    lib.sy_front_destroy.argtypes = [vp]
    _lib = lib
    return lib


class FrontLib:
    """One running front: a grpc++ server on `address` (see front.h). grpc core refuses
    metadata over `max_metadata_bytes` before any handler runs (and its answer, from the
    grpc core that the library links, may be a reset stream rather than a status)."""

    def __init__(
        self,
        address: str,
        *,
        reuse_port: bool,
        max_message_bytes: int,
        max_metadata_bytes: int,
        cert_pem: bytes = b"",
        key_pem: bytes = b"",
        client_ca_pem: bytes = b"",
    ) -> None:
        self._lib = lib = _load()
        error = ctypes.create_string_buffer(_ERROR_BYTES)
        handle = lib.sy_front_start(
            address.encode(),
            int(reuse_port),
            max_message_bytes,
            max_metadata_bytes,
            cert_pem,
            key_pem,
            client_ca_pem,
            error,
            _ERROR_BYTES,
        )
        if not handle:
            raise port_in_use(address) from RuntimeError(error.value.decode(errors="replace"))
        self._handle: int | None = handle
        self.port: int = lib.sy_front_port(handle)
        self.event_fd: int = lib.sy_front_event_fd(handle)
        self._data = ctypes.c_void_p()
        self._size = ctypes.c_size_t()

    def poll(self) -> bytes:
        """Every event since the last poll (serialized FrontEvents; b"" when none)."""
        if self._handle is None:  # closed
            return b""
        self._lib.sy_front_poll(self._handle, ctypes.byref(self._data), ctypes.byref(self._size))
        return self._taken()

    def _taken(self) -> bytes:
        """The bytes the library handed out in `_data` (b"" for none), freed."""
        if not self._data.value:
            return b""
        try:
            return ctypes.string_at(self._data.value, self._size.value)
        finally:
            self._lib.sy_front_free(self._data)

    # ---- the direct path (runtime_cpp/src/front/direct.h) ------------------------------

    def vocab(self, table: bytes) -> int:
        """A vocabulary table's handle (Vocabulary.byte_table's format); -1: refused."""
        if self._handle is None:
            return -1
        return int(self._lib.sy_front_vocab(self._handle, table, len(table)))

    def direct_start(
        self, stream: int, attempt: int, call: int, vocab: int, pending: bytes, last_at: float
    ) -> bool:
        """Hand `attempt` of worker stream `stream` over: its chunks go to `call`."""
        if self._handle is None:
            return False
        rc = self._lib.sy_front_direct_start(
            self._handle, stream, attempt, call, vocab, pending, len(pending), last_at
        )
        return bool(rc == 0)

    def direct_stop(self, stream: int, attempt: int) -> bytes:
        """Take `attempt` back: its serialized Handback (b"": it was not handed over)."""
        if self._handle is None:
            return b""
        self._lib.sy_front_direct_stop(
            self._handle, stream, attempt, ctypes.byref(self._data), ctypes.byref(self._size)
        )
        return self._taken()

    def feed(self, stream: int, raw: bytes) -> bytes:
        """One worker message of `stream`: the serialized FeedResult. Raises ValueError
        when the message does not parse."""
        if self._handle is None:
            raise ValueError("the native front is closed")
        rc = self._lib.sy_front_feed(
            self._handle, stream, raw, len(raw), ctypes.byref(self._data), ctypes.byref(self._size)
        )
        if rc != 0:
            raise ValueError("a worker message that does not parse")
        return self._taken()

    def apply(self, commands: bytes) -> None:
        """Queue serialized FrontCommands; the front's thread applies them in order."""
        if self._handle is not None:  # else closed: the calls are gone
            self._lib.sy_front_apply(self._handle, commands, len(commands))

    def bad_batches(self) -> int:
        """Command batches that did not parse (a bug of ours: none, ever)."""
        if self._handle is None:
            return 0
        return int(self._lib.sy_front_bad_batches(self._handle))

    def open_calls(self) -> int:
        if self._handle is None:
            return 0
        return int(self._lib.sy_front_open_calls(self._handle))

    def shutdown(self, grace_s: float) -> None:
        """Blocks until every call has ended (those open after `grace_s` are cancelled)."""
        if self._handle is not None:
            self._lib.sy_front_shutdown(self._handle, grace_s)

    def close(self) -> None:
        handle, self._handle = self._handle, None
        if handle is not None:
            self._lib.sy_front_destroy(handle)
