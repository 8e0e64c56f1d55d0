"""NumPy's `.npz` files read with torch alone, so the package keeps torch as its only array
library: an `.npz` is a zip of `.npy` files, and an `.npy` is a short header (a Python dict
literal giving the dtype, the order and the shape) followed by the raw array.

Reads what `numpy.savez` and `numpy.savez_compressed` write: format versions 1 to 3, C or
Fortran order, little- or big-endian, the float, integer and bool dtypes torch has. Object
arrays (pickles) are refused, never unpickled.
"""

from __future__ import annotations

import ast
import math
import sys
import zipfile
from pathlib import Path

import torch

from saecodec.errors import SAEFormatError

_MAGIC = b"\x93NUMPY"
#: NumPy's type codes (kind and size) as torch dtypes.
_DTYPES = {"f2": torch.float16, "f4": torch.float32, "f8": torch.float64,
           "i1": torch.int8, "i2": torch.int16, "i4": torch.int32, "i8": torch.int64,
           "u1": torch.uint8, "b1": torch.bool}


def read_npz(path: Path) -> dict[str, torch.Tensor]:
    """Every array in `.npz` file `path`, by name (the member's name less `.npy`); a missing
    or foreign file, or an array this reader cannot read, is refused naming the file and the
    array."""
    if not path.is_file():
        raise SAEFormatError(path, "is missing")
    try:
        archive = zipfile.ZipFile(path)
    except (OSError, zipfile.BadZipFile) as error:
        raise SAEFormatError(path, f"is not a readable .npz (zip) file ({error})") from None
    arrays: dict[str, torch.Tensor] = {}
    with archive:
        for member in archive.infolist():
            if not member.filename.endswith(".npy"):
                raise SAEFormatError(path, f"holds {member.filename!r}, which is not a .npy "
                                     "array", member.filename)
            key = member.filename.removesuffix(".npy")
            data = bytearray(member.file_size)  # one copy: the tensor will own this memory
            try:
                with archive.open(member) as stream:
                    read = memoryview(data)
                    while read:  # ZipExtFile.read, chunk by chunk, into the one buffer
                        chunk = stream.read(min(len(read), 1 << 24))
                        if not chunk:
                            raise SAEFormatError(path, f"array {key!r} is truncated", key)
                        read[:len(chunk)] = chunk
                        read = read[len(chunk):]
            except SAEFormatError:
                raise
            except Exception as error:  # a corrupt member: zipfile or zlib says why
                raise SAEFormatError(path, f"array {key!r} cannot be read ({error})",
                                     key) from None
            arrays[key] = _array(data, path, key)
    return arrays


def _array(data: bytearray, path: Path, key: str) -> torch.Tensor:
    """The array in `.npy` bytes `data` (member `key` of `path`)."""
    def bad(problem: str) -> SAEFormatError:
        return SAEFormatError(path, f"array {key!r} {problem}", key)

    if not data.startswith(_MAGIC) or len(data) < 10:
        raise bad("is not a .npy array (no NUMPY magic)")
    major = data[6]
    if major == 1:
        size, start = int.from_bytes(data[8:10], "little"), 10
    elif major in (2, 3):
        size, start = int.from_bytes(data[8:12], "little"), 12
    else:
        raise bad(f"has .npy format version {major}, which this reader does not know")
    try:
        text = bytes(data[start:start + size]).decode("utf-8" if major == 3 else "latin1")
        header = ast.literal_eval(text)  # a literal only: never evaluates code
    except (ValueError, SyntaxError, UnicodeDecodeError):
        raise bad("has an unreadable header") from None
    if not isinstance(header, dict) or not {"descr", "fortran_order", "shape"} <= set(header):
        raise bad("has a header without descr, fortran_order and shape")
    descr, fortran, shape = header["descr"], header["fortran_order"], header["shape"]
    if not (isinstance(shape, tuple) and all(isinstance(n, int) and n >= 0 for n in shape)):
        raise bad(f"has shape {shape!r}, which is not a tuple of sizes")
    if not isinstance(descr, str) or len(descr) < 3 or descr[0] not in "<>|=" or \
            descr[1:] not in _DTYPES:
        raise bad(f"has dtype {descr!r}, which this reader does not read (known: "
                  f"{', '.join(_DTYPES)}; object arrays are never unpickled)")
    dtype = _DTYPES[descr[1:]]
    itemsize = int(descr[2:])
    count = math.prod(shape)
    offset = start + size
    if len(data) - offset != count * itemsize:
        raise bad(f"holds {len(data) - offset} bytes of data; shape {list(shape)} of {descr} "
                  f"needs {count * itemsize}")
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    raw = torch.frombuffer(data, dtype=torch.uint8, offset=offset, count=count * itemsize)
    big_endian = descr[0] == ">" or (descr[0] == "=" and sys.byteorder == "big")
    if itemsize > 1 and big_endian != (sys.byteorder == "big"):
        # the file's byte order is not this machine's: reverse each element's bytes
        raw = raw.view(count, itemsize).flip(-1).reshape(-1)
    flat = raw.view(dtype)
    if fortran:
        # column-major: the reversed shape in row-major order, transposed back
        return flat.reshape(tuple(reversed(shape))).permute(
            *reversed(range(len(shape)))).contiguous()
    return flat.reshape(shape)
