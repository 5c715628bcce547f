"""The GPU architectures whose SASS an extension module embeds, read from its `.nv_fatbin` ELF section without
NVIDIA's tools (cuobjdump is not on every machine that builds jax_msa).

A fatbin section is a run of containers: a 16-byte header (magic 0xBA55ED50, u16 version, u16 header size,
u64 payload size) followed by entries, each a header (u16 kind: 1 PTX, 2 ELF/SASS; u16 version; u32 header size;
u64 padded payload size; ...; u32 SM version at byte 28) and its payload. Payloads may be compressed; the entry
headers are not."""

from __future__ import annotations

import struct

FATBIN_MAGIC = 0xBA55ED50
KIND_PTX, KIND_SASS = 1, 2


def _section(data: bytes, wanted: str) -> tuple[int, int] | None:
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names_offset = headers[shstrndx][4]
    for name, _, _, _, offset, size, *_ in headers:
        start = names_offset + name
        if data[start:data.index(b"\0", start)].decode() == wanted:
            return offset, size
    return None


def fatbin_entries(path: str) -> list[list[tuple[int, int]]]:
    """Per fatbin container (one per CUDA translation unit), its entries as (kind, SM version), e.g. (2, 90)."""
    data = open(path, "rb").read()
    if data[:4] != b"\x7fELF":
        raise ValueError(f"{path} is not an ELF file")
    found = _section(data, ".nv_fatbin")
    if found is None:
        return []
    offset, size = found
    containers, pos = [], offset
    while pos + 16 <= offset + size:
        magic, _, header_size, payload_size = struct.unpack_from("<IHHQ", data, pos)
        if magic != FATBIN_MAGIC:
            pos += 8  # containers are 8-byte aligned
            continue
        entries, p, end = [], pos + header_size, pos + header_size + payload_size
        while p < end:
            kind, _, entry_header, padded = struct.unpack_from("<HHIQ", data, p)
            entries.append((kind, struct.unpack_from("<I", data, p + 28)[0]))
            p += entry_header + padded
        containers.append(entries)
        pos = end
    return containers
