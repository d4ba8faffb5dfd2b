# Image files for tests: one-colour JPEGs, headers claiming huge sizes, a set of broken files, a folder's bytes.
from __future__ import annotations

import io
import struct
import zlib
from pathlib import Path

from PIL import Image

from edge_agent.data.image_files import MAX_PIXELS


def png_header(width: int, height: int) -> bytes:
    """The signature, IHDR and the start of an IDAT chunk of an RGB PNG claiming width x height pixels."""
    chunks = [b"IHDR" + struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0), b"IDAT" + zlib.compress(b"\0" * 64)]
    framed = [struct.pack(">I", len(chunk) - 4) + chunk + struct.pack(">I", zlib.crc32(chunk)) for chunk in chunks]
    return b"\x89PNG\r\n\x1a\n" + b"".join(framed)


def jpeg_claiming(width: int, height: int) -> bytes:
    """A real baseline JPEG whose frame header (SOF0) is patched to claim width x height pixels."""
    real = solid_jpeg((200, 40, 10), 16)
    at = real.index(b"\xff\xc0") + 5
    return real[:at] + struct.pack(">HH", height, width) + real[at + 4 :]


def solid_jpeg(colour: tuple[int, int, int], size: int) -> bytes:
    """The bytes of a one-colour RGB JPEG of size x size pixels."""
    buffer = io.BytesIO()
    Image.new("RGB", (size, size), colour).save(buffer, format="JPEG", quality=95)
    return buffer.getvalue()


def broken_files(folder: Path) -> dict[str, str]:
    """Writes one file of each broken kind into folder; returns name -> a phrase its reason must contain."""
    good = solid_jpeg((10, 200, 30), 64)
    (folder / "cut.jpg").write_bytes(good[: len(good) // 3])
    (folder / "notes.png").write_text("camera notes, not a picture\n")
    (folder / "empty.jpg").write_bytes(b"")
    (folder / "bomb.png").write_bytes(png_header(8000, 8000))
    (folder / "huge.png").write_bytes(png_header(100_000, 100_000))
    (folder / "bomb.jpg").write_bytes(jpeg_claiming(65000, 65000))
    Image.new("RGB", (8, 8)).save(folder / "anim.gif", format="GIF")
    return {
        "cut.jpg": "truncated",
        "notes.png": "not an image",
        "empty.jpg": "not an image",
        "bomb.png": f"8000x8000 pixels is more than the {MAX_PIXELS}",
        "huge.png": "decompression bomb guard: Image size (10000000000 pixels)",
        "bomb.jpg": "decompression bomb guard: Image size (4225000000 pixels)",
        "anim.gif": "GIF is not JPEG or PNG",
    }


def contents(folder: Path) -> dict[str, bytes]:
    """Every file under folder (hidden ones too) -> its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
