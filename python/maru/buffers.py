"""Helpers for buffers that map pool memory."""

from __future__ import annotations

import ctypes
from typing import Any


class _PyBuffer(ctypes.Structure):
    # The layout of CPython's Py_buffer (stable since 3.3).
    _fields_ = [
        ("buf", ctypes.c_void_p),
        ("obj", ctypes.py_object),
        ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t),
        ("readonly", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p),
        ("shape", ctypes.POINTER(ctypes.c_ssize_t)),
        ("strides", ctypes.POINTER(ctypes.c_ssize_t)),
        ("suboffsets", ctypes.POINTER(ctypes.c_ssize_t)),
        ("internal", ctypes.c_void_p),
    ]


_get_buffer = ctypes.pythonapi.PyObject_GetBuffer
_get_buffer.argtypes = [ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int]
_get_buffer.restype = ctypes.c_int
_release_buffer = ctypes.pythonapi.PyBuffer_Release
_release_buffer.argtypes = [ctypes.POINTER(_PyBuffer)]
_release_buffer.restype = None


def address_of(buffer: Any) -> int:
    """Return the virtual address of the first byte of a buffer.

    Works for read-only buffers too (``MemoryInfo.view``), where
    ``ctypes.c_char.from_buffer`` refuses. Useful to register a mapping with
    another library (e.g. ``cudaHostRegister``) or to look its pages up in
    ``/proc/self/pagemap``. The address is valid while the buffer is.

    Args:
        buffer: any object that exports the buffer protocol (memoryview, mmap,
            bytes, numpy array...).
    """
    view = _PyBuffer()
    _get_buffer(buffer, ctypes.byref(view), 0)  # PyBUF_SIMPLE
    try:
        return int(view.buf or 0)
    finally:
        _release_buffer(ctypes.byref(view))
