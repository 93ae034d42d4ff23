"""The chunk entry format: a KV chunk with the metadata a reader needs to use it.

LMCache's local-disk backend writes raw bytes and keeps shape, dtype and format
in its own process's memory; nobody else can use the file. A chunk entry
carries them in a header, so any process that can read the entry can rebuild
the chunk. Byte by byte (integers little-endian):

======  ====  ==============================================================
offset  size  field
======  ====  ==============================================================
0       8     magic ``b"MARUKVC\\0"``
8       4     format version, ``1``
12      4     ``header_size``: where the payload starts; a multiple of 4096,
              so the payload is page-aligned in every mapping
16      8     ``payload_size`` in bytes
24      4     ``meta_size``: length of the metadata that follows
28      4     CRC-32 (zlib) of the metadata bytes
32      meta  metadata: UTF-8 JSON object (below)
...           zero padding up to ``header_size``
hs      ps    the payload: the chunk's bytes exactly as the writer had them
======  ====  ==============================================================

The metadata object has the keys ``key`` (the writer's full key string, which
readers check against the key they asked for), ``fmt`` (e.g. ``"KV_2LTD"``),
``shapes`` (list of shapes, one per tensor group), ``dtypes`` (``"bfloat16"``...,
one per group), and ``cached_positions`` (list of ints, or null). Readers
ignore keys they do not know; a new incompatible layout changes the version.
"""

from __future__ import annotations

import errno
import json
import struct
import zlib
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from .errors import EntryFormatError

MAGIC = b"MARUKVC\0"
VERSION = 1
ALIGN = 4096
_FIXED = struct.Struct("<8sIIQII")  # magic, version, header_size, payload_size, meta_size, crc
FIXED_SIZE = _FIXED.size  # 32


@dataclass
class ChunkMeta:
    """What a reader needs to rebuild a chunk (the header's JSON object)."""

    key: str
    fmt: str
    shapes: List[List[int]]
    dtypes: List[str]
    cached_positions: Optional[List[int]] = None
    extra: Dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> bytes:
        """The metadata as compact UTF-8 JSON."""
        obj: Dict[str, Any] = dict(self.extra)
        obj.update(
            key=self.key,
            fmt=self.fmt,
            shapes=self.shapes,
            dtypes=self.dtypes,
            cached_positions=self.cached_positions,
        )
        return json.dumps(obj, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "ChunkMeta":
        """Parse the metadata; raises :class:`EntryFormatError` when keys are missing."""
        try:
            obj = json.loads(raw.decode())
            meta = cls(
                key=str(obj.pop("key")),
                fmt=str(obj.pop("fmt")),
                shapes=[[int(d) for d in s] for s in obj.pop("shapes")],
                dtypes=[str(d) for d in obj.pop("dtypes")],
                cached_positions=obj.pop("cached_positions", None),
            )
            meta.extra = obj
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise EntryFormatError(errno.EBADMSG, f"chunk header: bad metadata ({e})") from e
        if len(meta.shapes) != len(meta.dtypes):
            raise EntryFormatError(errno.EBADMSG, "chunk header: shapes and dtypes differ in length")
        return meta


def header_size_for(meta_json: bytes) -> int:
    """Bytes of header (fixed part, metadata, padding) for this metadata."""
    need = FIXED_SIZE + len(meta_json)
    return (need + ALIGN - 1) // ALIGN * ALIGN


def encode_header(meta: ChunkMeta, payload_size: int) -> bytes:
    """Return the complete header (padding included) for a payload of ``payload_size`` bytes."""
    raw = meta.to_json()
    size = header_size_for(raw)
    fixed = _FIXED.pack(MAGIC, VERSION, size, payload_size, len(raw), zlib.crc32(raw))
    return fixed + raw + bytes(size - FIXED_SIZE - len(raw))


@dataclass
class ChunkHeader:
    """A parsed header: where the payload is and what it holds."""

    header_size: int
    payload_size: int
    meta: ChunkMeta


def decode_header(buf: Any, entry_size: int) -> ChunkHeader:
    """Parse the header at the start of an entry.

    Args:
        buf: a buffer of the entry (at least its header; a mapping of the whole
            entry is fine, nothing is copied beyond the metadata).
        entry_size: the entry's size in bytes, to check the payload fits.

    Raises:
        EntryFormatError: not a chunk entry, an unknown version, a corrupt
            or truncated header.
    """
    with memoryview(buf) as view:
        return _decode(view, entry_size)


def _decode(view: memoryview, entry_size: int) -> ChunkHeader:
    if entry_size < FIXED_SIZE or len(view) < FIXED_SIZE:
        raise EntryFormatError(errno.EBADMSG, f"chunk header: entry of {entry_size} bytes is too short")
    magic, version, hsize, psize, msize, crc = _FIXED.unpack_from(view, 0)
    if magic != MAGIC:
        raise EntryFormatError(errno.EBADMSG, "chunk header: not a maru chunk entry (bad magic)")
    if version != VERSION:
        raise EntryFormatError(errno.EBADMSG, f"chunk header: version {version}, this reader knows {VERSION}")
    if hsize % ALIGN or hsize < FIXED_SIZE + msize or hsize + psize > entry_size:
        raise EntryFormatError(errno.EBADMSG, f"chunk header: sizes do not fit (header {hsize}, payload {psize}, entry {entry_size})")
    raw = bytes(view[FIXED_SIZE:FIXED_SIZE + msize])
    if zlib.crc32(raw) != crc:
        raise EntryFormatError(errno.EBADMSG, "chunk header: metadata checksum mismatch")
    return ChunkHeader(hsize, psize, ChunkMeta.from_json(raw))
