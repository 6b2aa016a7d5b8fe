"""The SM architectures a shared object holds SASS for, read from the ``.nv_fatbin`` section of its ELF
file (no CUDA needed): what ``deep_ep.Buffer.is_sm90_compiled`` answers for the extension
``deep_ep._C``.
"""

from __future__ import annotations

import struct

__all__ = ["sass_architectures"]


def sass_architectures(path: str) -> frozenset[int]:
    """The SM architectures (e.g. 90 for sm_90) with SASS in the shared object at ``path``, read from its
    ``.nv_fatbin`` section (entries of kind 2 are ELF cubins, their header holds the arch). Empty when
    the file cannot be read or holds no fatbin."""
    try:
        with open(path, "rb") as handle:
            data = handle.read()
        if data[:4] != b"\x7fELF" or data[4] != 2:  # ELF64 only
            return frozenset()
        (section_offset,) = struct.unpack_from("<Q", data, 0x28)
        entry_size, num_sections, names_index = struct.unpack_from("<HHH", data, 0x3A)
        sections = [
            struct.unpack_from("<IIQQQQ", data, section_offset + index * entry_size) for index in range(num_sections)
        ]
        names_offset = sections[names_index][4]

        def name(offset: int) -> bytes:
            start = names_offset + offset
            return data[start : data.index(b"\0", start)]

        archs: set[int] = set()
        for name_offset, _, _, _, offset, size in sections:
            if name(name_offset) != b".nv_fatbin":
                continue
            position, end = offset, offset + size
            while position + 16 <= end:
                magic, _, header_size, fat_size = struct.unpack_from("<IHHQ", data, position)
                if magic != 0xBA55ED50:
                    position += 8  # fatbins are 8-byte aligned inside the section
                    continue
                entry, entries_end = position + header_size, position + header_size + fat_size
                while entry + 32 <= entries_end:
                    kind, _, entry_header_size, entry_size_bytes = struct.unpack_from("<HHIQ", data, entry)
                    (arch,) = struct.unpack_from("<I", data, entry + 28)
                    if kind == 2:
                        archs.add(arch)
                    entry += entry_header_size + entry_size_bytes
                position = entries_end
        return frozenset(archs)
    except (OSError, struct.error, ValueError, IndexError):
        return frozenset()
