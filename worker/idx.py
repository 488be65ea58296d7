"""A reader for the IDX files that MNIST-style datasets ship in (gzip-compressed or not).

The format is a 4-byte magic (two zero bytes, a type code, the number of
dimensions), one big-endian 4-byte size per dimension, then the data. A file
cut short, of another type, or with trailing bytes is refused naming the file:
a damaged download must not become a quietly shorter dataset.

Example::

    images = read_idx(Path("train-images-idx3-ubyte.gz"))   # uint8, [60000, 28, 28]
"""
from __future__ import annotations

import gzip
import struct
import zlib
from pathlib import Path

import torch

# the IDX type codes and the dtypes they hold (all multi-byte types are big-endian)
_TYPES = {0x08: (torch.uint8, ">u1"), 0x09: (torch.int8, ">i1"), 0x0B: (torch.int16, ">i2"),
          0x0C: (torch.int32, ">i4"), 0x0D: (torch.float32, ">f4"), 0x0E: (torch.float64, ">f8")}


class IdxError(ValueError):
    """An IDX file that is not what its header says."""


def read_idx(path: Path) -> torch.Tensor:
    """The tensor an IDX file holds, with the dimensions its header gives."""
    raw = path.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as exc:
            raise IdxError(f"{path}: not a readable gzip file ({exc})") from None
    return parse_idx(raw, str(path))


def parse_idx(raw: bytes, where: str = "IDX data") -> torch.Tensor:
    """Parse IDX bytes; ``where`` names the source in errors."""
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise IdxError(f"{where}: not an IDX file (its first bytes are {raw[:4].hex() or 'missing'})")
    code, dims = raw[2], raw[3]
    if code not in _TYPES:
        raise IdxError(f"{where}: unknown IDX type code 0x{code:02x}")
    if dims == 0:
        raise IdxError(f"{where}: an IDX file with no dimensions")
    header = 4 + 4 * dims
    if len(raw) < header:
        raise IdxError(f"{where}: the header is cut short ({len(raw)} bytes, {header} needed)")
    shape = struct.unpack(f">{dims}I", raw[4:header])
    dtype, numpy_type = _TYPES[code]
    itemsize = torch.empty((), dtype=dtype).element_size()
    count = 1
    for size in shape:
        count *= size
    expected = header + count * itemsize
    if len(raw) != expected:
        raise IdxError(f"{where}: the header announces shape {list(shape)} ({expected} bytes in "
                       f"all) but the file holds {len(raw)} bytes")
    import numpy
    values = numpy.frombuffer(raw, dtype=numpy_type, count=count, offset=header)
    return torch.from_numpy(values.astype(values.dtype.newbyteorder("="))).reshape(shape)
