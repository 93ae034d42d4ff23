"""Physical frame numbers of mapped pages, from /proc/self/pagemap (root only)."""

from __future__ import annotations

import mmap
import os
import struct
from typing import Any

import maru

PAGE = mmap.PAGESIZE
_PFN_MASK = (1 << 55) - 1
_PRESENT = 1 << 63


def pfn_of(buffer: Any, offset: int = 0) -> int:
    """The PFN of the page holding byte ``offset`` of ``buffer`` (touched first).

    Raises:
        AssertionError: the page is not present, or the PFN reads as 0 (not root).
    """
    view = memoryview(buffer)
    _ = view[offset]  # fault the page in
    addr = maru.address_of(view) + offset
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(addr // PAGE * 8)
        (entry,) = struct.unpack("<Q", f.read(8))
    assert entry & _PRESENT, f"page at {addr:#x} not present"
    pfn = entry & _PFN_MASK
    assert pfn != 0, "PFN reads as 0: /proc/self/pagemap needs CAP_SYS_ADMIN"
    return pfn


def pfn_of_file(path: str, offset: int = 0) -> int:
    """The PFN of the page holding byte ``offset`` of a file (a memfs entry, or a raw pool's
    device or file at an entry's offset), mapped read-only here: only that page is mapped."""
    start = offset // PAGE * PAGE
    fd = os.open(path, os.O_RDONLY)
    try:
        mm = mmap.mmap(fd, PAGE, access=mmap.ACCESS_READ, offset=start)
    finally:
        os.close(fd)
    try:
        view = memoryview(mm)
        try:
            return pfn_of(view, offset - start)
        finally:
            view.release()
    finally:
        mm.close()
