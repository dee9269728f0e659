"""Image files decoded to uint8 pixels (height, width, channels): the same conversion and resizing
for streamed training batches (meshfit.data.folders), folders loaded into memory
(datasets.image_folder) and inference (meshfit.serve.inference).

Bad data:
  - a file whose header Pillow cannot read (corrupt, truncated before its size, not an image):
    `header_problem` says why (a folder's scan skips it);
  - a file whose header reads but whose pixels do not decode: a one-line MeshfitError naming the
    file when its batch is decoded (the scan does not decode pixels, to stay cheap);
  - every mode is converted: grey and palette images to RGB (channels=3) or L (channels=1);
    transparency (RGBA, LA, palette with a transparent colour) composited on white; 16-bit
    images (I;16, I) scaled to 8 bits (value >> 8), not clipped; CMYK and YCbCr through Pillow;
    animated GIF / WebP: the first frame. Images are resized to image_size (bilinear, Pillow)
    unless already that size; a JPEG at least twice as large in both directions is first decoded
    at a reduced scale (libjpeg's DCT scaling, as Pillow's draft mode; slightly different from a
    full decode then resize).
JPEGs are decoded by libjpeg-turbo through simplejpeg, which needs no GIL (the same pixels as
Pillow for RGB; for channels=1 libjpeg's luma channel, which can differ from Pillow's
convert("L") of the decoded RGB by a few levels where the colour subsampling blurs, e.g. 6 on
noise). Small PNGs (at most SMALL_PNG_PIXELS, 8-bit grey or RGB, no transparency) are decoded by
libspng through pyspng: the same pixels as Pillow for an eighth of the CPU time (9 vs 72 us for a
28x28 digit, where Pillow's per-call overhead dominates). pyspng holds the GIL while it decodes,
so larger PNGs go through Pillow, which decodes in parallel threads. Every other file, CMYK JPEGs
and files these decoders refuse go through Pillow too.
"""

from __future__ import annotations

import io
import os

import numpy as np

from meshfit.errors import MeshfitError

HEADER_BYTES = 65536  # bytes read at scan to check a JPEG's header
READ_BYTES = 1 << 20  # a file is read in pieces of this many bytes
SMALL_PNG_PIXELS = 64 * 64  # larger PNGs go through Pillow (pyspng holds the GIL while it decodes)


def header_problem(path: str) -> str | None:
    """Why the header of `path` cannot be read as an image, or None when it can."""
    from PIL import Image

    try:
        with open(path, "rb") as f:
            head = f.read(HEADER_BYTES)
        if head[:3] == b"\xff\xd8\xff" and _jpeg_header_size(head):
            return None
        with Image.open(path) as im:
            if im.width < 1 or im.height < 1:
                return "empty image (0 pixels)"
    except Exception as e:  # Pillow raises many kinds (UnidentifiedImageError, OSError, SyntaxError...)
        return f"unreadable image: {_reason(e)}"
    return None


def _jpeg_header_size(head: bytes) -> tuple[int, int] | None:
    """(height, width) from the start of a JPEG file via simplejpeg; None if it cannot tell."""
    try:
        import simplejpeg

        height, width, _, _ = simplejpeg.decode_jpeg_header(head)
    except (ImportError, ValueError):
        return None
    return (height, width) if height > 0 and width > 0 else None


def _reason(error: Exception) -> str:
    from PIL import UnidentifiedImageError

    if isinstance(error, UnidentifiedImageError):  # its text names an in-memory buffer, not the file
        return "not an image file: no PNG, JPEG, BMP, GIF, WebP or other format Pillow reads"
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def load_image(path: str, image_size: tuple[int, int], channels: int,
               out: np.ndarray | None = None) -> np.ndarray:
    """One image as uint8 (height, width, channels), converted and resized as the module says;
    written into `out` when given (an array of that shape)."""
    height, width = image_size
    if out is None:
        out = np.empty((height, width, channels), np.uint8)
    try:
        data = _read(path)
        if data[:3] == b"\xff\xd8\xff":
            decoded = _decode_jpeg(data, out)
        else:
            decoded = data[:8] == PNG_SIGNATURE and _decode_png(data, out)
        if not decoded:
            _decode_with_pillow(data, out)
    except Exception as e:  # Pillow raises many kinds (OSError, SyntaxError, ValueError...)
        raise MeshfitError(f"cannot read image {path} ({_reason(e)}); fix or remove it") from None
    return out


def _read(path: str) -> bytes:
    """A file's bytes, with os.read: half the CPU time of open().read() for small files."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        data = os.read(fd, size + 1)
        if len(data) == size:  # the whole file, the usual case
            return data
        chunks = [data]  # a short read, or a file that grew: read on to its end
        while chunk := os.read(fd, READ_BYTES):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _check_pixels(width: int, height: int) -> None:
    """A ValueError for an image of more pixels than Pillow's MAX_IMAGE_PIXELS (a decompression
    bomb: a small file that would decode to gigabytes)."""
    from PIL import Image

    if Image.MAX_IMAGE_PIXELS and width * height > Image.MAX_IMAGE_PIXELS:
        raise ValueError(f"{width}x{height} pixels, more than the {Image.MAX_IMAGE_PIXELS:,} "
                         "allowed (PIL.Image.MAX_IMAGE_PIXELS)")


def _decode_jpeg(data: bytes, out: np.ndarray) -> bool:
    """Decode a JPEG into `out` with libjpeg-turbo (simplejpeg, without the GIL); False where
    Pillow must do it (no simplejpeg, CMYK, or data simplejpeg refuses)."""
    try:
        import simplejpeg
    except ImportError:
        return False
    height, width, channels = out.shape
    try:
        rows, cols, colorspace, _ = simplejpeg.decode_jpeg_header(data)
    except ValueError:
        return False  # e.g. a truncated file: Pillow decodes it or names the problem
    _check_pixels(cols, rows)
    try:
        if colorspace not in ("Gray", "YCbCr", "RGB"):
            return False  # CMYK, YCCK: Pillow converts them
        space = "RGB" if channels == 3 else "GRAY"
        if (rows, cols) == (height, width):
            simplejpeg.decode_jpeg(data, space, buffer=out)
            return True
        scaled = rows >= 2 * height and cols >= 2 * width  # DCT scaling, as Pillow's draft mode
        array = simplejpeg.decode_jpeg(data, space, min_height=height if scaled else 0,
                                       min_width=width if scaled else 0)
    except ValueError:
        return False  # e.g. a truncated file: Pillow decodes it or names the problem
    _resize(array, out)
    return True


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_PNG_GREY, _PNG_RGB = 0, 2  # IHDR colour types pyspng decodes here


def _decode_png(data: bytes, out: np.ndarray) -> bool:
    """Decode an 8-bit grey or RGB PNG without transparency into `out` with libspng (pyspng);
    False where Pillow must do it (no pyspng, other colour types or depths, transparency, RGB to
    grey, or data libspng refuses)."""
    try:
        import pyspng
    except ImportError:
        return False
    if len(data) < 33 or data[12:16] != b"IHDR" or data[24] != 8 or b"tRNS" in data:
        return False
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    _check_pixels(width, height)
    if width * height > SMALL_PNG_PIXELS:
        return False  # Pillow: it decodes without the GIL, so in parallel threads
    colour = data[25]
    channels = out.shape[2]
    if colour not in (_PNG_GREY, _PNG_RGB) or (colour == _PNG_RGB and channels == 1):
        return False  # Pillow's luma for RGB to grey
    try:
        array = pyspng.load(data)
    except (RuntimeError, ValueError):
        return False  # e.g. a truncated file: Pillow decodes it or names the problem
    if array.ndim == 2:
        array = array[..., None]
    if channels == 3 and array.shape[2] == 1:
        array = np.repeat(array, 3, axis=2)
    if array.shape == out.shape:
        out[...] = array
    else:
        _resize(array, out)
    return True


def _decode_with_pillow(data: bytes, out: np.ndarray) -> None:
    from PIL import Image

    height, width, channels = out.shape
    with Image.open(io.BytesIO(data)) as im:
        _check_pixels(im.width, im.height)
        if im.format == "JPEG" and im.width >= 2 * width and im.height >= 2 * height:
            im.draft(None, (width, height))
        im = _convert(im, "RGB" if channels == 3 else "L")
        if im.size != (width, height):
            im = im.resize((width, height), Image.Resampling.BILINEAR)
        out[...] = np.asarray(im, dtype=np.uint8).reshape(out.shape)


def _resize(array: np.ndarray, out: np.ndarray) -> None:
    """`array` (h, w, c) resized bilinearly into `out` (H, W, c) with Pillow."""
    from PIL import Image

    height, width, channels = out.shape
    image = Image.fromarray(array[..., 0] if channels == 1 else array)
    out[...] = np.asarray(image.resize((width, height), Image.Resampling.BILINEAR)).reshape(out.shape)


def _convert(im, mode: str):
    """`im` in `mode` ("RGB" or "L"): 16-bit scaled to 8 bits, transparency composited on white."""
    from PIL import Image

    if im.mode in ("I;16", "I;16L", "I;16B", "I;16N", "I"):
        im = Image.fromarray((np.clip(np.asarray(im), 0, 65535) >> 8).astype(np.uint8), "L")
    elif im.mode == "F":
        im = Image.fromarray(np.clip(np.asarray(im), 0, 255).astype(np.uint8), "L")
    if im.mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in im.info:
        white = Image.new("RGBA", im.size, (255, 255, 255, 255))
        im = Image.alpha_composite(white, im.convert("RGBA"))
    return im if im.mode == mode else im.convert(mode)


def default_workers() -> int:
    """Threads that read or decode images: one per core this process may use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def check_image_size(image_size, channels: int) -> tuple[int, int]:
    """(height, width) as ints; a MeshfitError unless both are positive and channels is 1 or 3."""
    if channels not in (1, 3):
        raise MeshfitError(f"channels must be 1 (grey) or 3 (RGB), got {channels}")
    size = tuple(int(s) for s in image_size)
    if len(size) != 2 or min(size) < 1:
        raise MeshfitError(f"image size must be two positive pixel counts (height width), got {image_size}")
    return size
