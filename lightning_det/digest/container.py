"""The ``torch.save`` zip container of a checkpoint: read it with clear errors, check every byte.

The manifest (:mod:`.manifest`) covers what a checkpoint *holds*; this module covers the file
that holds it, so that no flipped byte goes unnoticed, even one that leaves the loaded content
unchanged. ``torch.load`` checks neither CRC-32 nor structure, so a flipped byte of ``data.pkl``
loads as a different value. Here every byte of the file is accounted for:

- record data (``data.pkl``, tensor storages, version records): the CRC-32 of the central
  directory;
- local headers, names and data descriptors: equal to their central directory entry;
- the alignment padding torch writes into each local header (a ``FB`` extra field of ``Z``
  bytes): exactly that;
- central directory entries and the end record: the fields torch's writer sets (zero attributes,
  no comments), counts and offsets that chain the records back to back with no gap.

Zip64 files (a record or the file above 4 GiB, or 65535+ records) get the CRC checks only.
No Lightning import.
"""
from __future__ import annotations

import os
import struct
import zipfile
import zlib
from typing import Any, BinaryIO

import torch

__all__ = ["CheckpointFileError", "check_container", "read_checkpoint"]

_LOCAL = struct.Struct("<IHHHHHIIIHH")  # sig, version, flags, method, time, date, crc, csize, usize, nlen, elen
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")  # + made-by first; + clen, disk, iattr, eattr, offset
_END = struct.Struct("<IHHHHIIH")  # sig, disk, cd disk, entries here, entries, cd size, cd offset, comment len
_DESC = struct.Struct("<IIII")  # PK\7\8, crc, csize, usize
_END64 = struct.Struct("<IQHHIIQQQQ")  # sig, size, made-by, needed, disk, cd disk, entries here, entries, cd size, off
_LOCATOR = struct.Struct("<IIQI")  # sig, disk of the zip64 end record, its offset, disks
_LOCAL_SIG, _CENTRAL_SIG, _END_SIG, _DESC_SIG = 0x04034B50, 0x02014B50, 0x06054B50, 0x08074B50
_END64_SIG, _LOCATOR_SIG = 0x06064B50, 0x07064B50


class CheckpointFileError(RuntimeError):
    """A file that is not a complete, readable checkpoint (truncated, not a torch.save file)."""


def _problem(entry: str, problem: str) -> dict:
    return {"entry": entry, "problem": problem}


def _crc_problems(zf: zipfile.ZipFile) -> list[dict]:
    out = []
    for info in zf.infolist():
        try:
            with zf.open(info) as r:
                crc = 0
                while chunk := r.read(1 << 24):
                    crc = zlib.crc32(chunk, crc)
        except (zipfile.BadZipFile, OSError, EOFError) as exc:
            out.append(_problem(f"zip record {info.filename}", f"unreadable or corrupted ({exc})"))
    return out


def _layout_problems(f: BinaryIO, zf: zipfile.ZipFile, size: int) -> list[dict]:
    """Every structural byte against what torch's zip writer produces (see the module doc)."""
    infos = zf.infolist()
    zip64 = len(infos) >= 0xFFFF or size >= 0xFFFFFFFF
    if zip64:
        return []
    out = []
    pos = 0
    central: list[tuple] = []
    f.seek(zf.start_dir)
    for info in infos:
        fields = _CENTRAL.unpack(f.read(_CENTRAL.size))
        name = f.read(fields[10])
        f.seek(fields[11] + fields[12], os.SEEK_CUR)
        central.append((fields, name))
    cd_end = f.tell()
    for info, (c, cname) in zip(infos, central):
        entry = f"zip record {info.filename}"
        (csig, made_by, c_ver, c_flags, c_method, c_time, c_date, c_crc, c_cs, c_us, c_nl, c_el, c_cl, c_disk,
         c_iattr, c_eattr, c_off) = c
        if (csig, made_by, c_el, c_cl, c_disk, c_iattr, c_eattr) != (_CENTRAL_SIG, 0, 0, 0, 0, 0, 0):
            out.append(_problem(entry, "central directory entry has fields torch.save does not write"))
        if c_off != pos:
            out.append(_problem(entry, f"record starts at byte {c_off}, expected {pos} (right after the previous one)"))
            return out
        f.seek(pos)
        lh = _LOCAL.unpack(f.read(_LOCAL.size))
        lname = f.read(lh[9])
        extra = f.read(lh[10])
        zeroed = c_flags & 0x8  # sizes and CRC follow the data in a descriptor
        want = (_LOCAL_SIG, c_ver, c_flags, c_method, c_time, c_date, 0 if zeroed else c_crc,
                0 if zeroed else c_cs, 0 if zeroed else c_us, c_nl)
        if lh[:10] != want or lname != cname:
            out.append(_problem(entry, "local header disagrees with the central directory"))
        if extra and not (extra[:2] == b"FB" and struct.unpack("<H", extra[2:4])[0] == len(extra) - 4
                          and extra[4:] == b"Z" * (len(extra) - 4)):
            out.append(_problem(entry, "alignment padding of the local header is not torch.save's"))
        pos += _LOCAL.size + lh[9] + lh[10] + c_cs
        if zeroed:
            f.seek(pos)
            if _DESC.unpack(f.read(_DESC.size)) != (_DESC_SIG, c_crc, c_cs, c_us):
                out.append(_problem(entry, "data descriptor disagrees with the central directory"))
            pos += _DESC.size
    if pos != zf.start_dir:
        out.append(_problem("zip structure", f"central directory starts at byte {zf.start_dir}, expected {pos}"))
    f.seek(cd_end)
    n, cd_size = len(infos), cd_end - zf.start_dir
    end_at = cd_end
    if f.read(4) == struct.pack("<I", _END64_SIG):  # torch's writer adds the zip64 end records when writing to a stream
        f.seek(cd_end)
        if (_END64.unpack(f.read(_END64.size)) != (_END64_SIG, 44, 0x031E, 0x2D, 0, 0, n, n, cd_size, zf.start_dir)
                or _LOCATOR.unpack(f.read(_LOCATOR.size)) != (_LOCATOR_SIG, 0, cd_end, 1)):
            out.append(_problem("zip structure", "zip64 end records are not what torch.save writes"))
        end_at = cd_end + _END64.size + _LOCATOR.size
    f.seek(end_at)
    end = f.read(_END.size)
    if (len(end) != _END.size or _END.unpack(end) != (_END_SIG, 0, 0, n, n, cd_size, zf.start_dir, 0)
            or end_at + _END.size != size):
        out.append(_problem("zip structure", "end of central directory record is not what torch.save writes"))
    return out


def _open_zip(path: str | os.PathLike, f: BinaryIO) -> zipfile.ZipFile:
    try:
        return zipfile.ZipFile(f)
    except zipfile.BadZipFile as exc:
        size = os.fstat(f.fileno()).st_size
        raise CheckpointFileError(
            f"{path}: not a complete checkpoint file ({size} bytes, no zip end record: {exc}). A torch.save "
            "checkpoint is a zip archive that ends with its directory, so this file is truncated (an "
            "interrupted copy or save) or is not a torch.save checkpoint.") from None


def check_container(path: str | os.PathLike) -> list[dict]:
    """Problems of the zip container of ``path`` (empty when every byte checks out).

    Raises :class:`CheckpointFileError` when the file is not a zip archive at all (truncated, or
    another format).
    """
    with open(path, "rb") as f:
        zf = _open_zip(path, f)
        size = os.fstat(f.fileno()).st_size
        try:
            layout = _layout_problems(f, zf, size)
        except struct.error:
            layout = [_problem("zip structure", "a header runs past the end of the file")]
        return _crc_problems(zf) + layout


def read_checkpoint(path: str | os.PathLike, map_location: Any = "cpu", weights_only: bool | None = None) -> dict:
    """``torch.load`` a checkpoint file, with a clear error when it is truncated or not one.

    ``weights_only=None`` tries the safe loader first and falls back to the full unpickler for
    checkpoints holding hparams objects (checkpoints are trusted input here, as in Lightning).
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such checkpoint file")
    with open(path, "rb") as f:
        _open_zip(path, f)
    try:
        if weights_only is None:
            try:
                ckpt = torch.load(path, map_location=map_location, weights_only=True)
            except Exception:  # noqa: BLE001 - Lightning checkpoints may hold hparams objects
                ckpt = torch.load(path, map_location=map_location, weights_only=False)
        else:
            ckpt = torch.load(path, map_location=map_location, weights_only=weights_only)
    except Exception as exc:  # noqa: BLE001 - turned into one clear error naming the file
        raise CheckpointFileError(f"{path}: cannot read the checkpoint: {type(exc).__name__}: {exc}") from exc
    if not isinstance(ckpt, dict):
        raise CheckpointFileError(f"{path}: holds a {type(ckpt).__name__}, not a checkpoint dict")
    return ckpt
