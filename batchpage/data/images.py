"""One image from wherever a prompt names it -> a decoded RGB PIL image, bounded; its digest.

load_image takes a PIL image, encoded bytes, a HF datasets / Parquet image cell ({"bytes", "path"}),
a local path, a file:// URL, a data: URL, or an http(s) URL (only where allowed). Every source is
bounded before it costs anything: encoded bytes by ImageLimits.max_bytes (read or downloaded no
further than that), pixels by ImageLimits.max_pixels, checked on the header before any pixel is
decoded (decompression bombs). Every failure is an ImageError saying what is wrong and how to fix
it, so the caller can make it one row's error.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import os
import re
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from http.client import HTTPException
from pathlib import Path
from typing import Any
from urllib.parse import unquote_to_bytes, urlsplit

from PIL import Image, UnidentifiedImageError

# 8192 x 8192: a large photograph or scan, 192 MiB once decoded as RGB. Below PIL's own
# decompression-bomb warning threshold, so within the default PIL never warns; a job that means to
# read bigger images raises the limit.
DEFAULT_MAX_PIXELS = 64 * 1024 * 1024
# An encoded image: enough for a lossless scan at the pixel limit's order of magnitude.
DEFAULT_MAX_BYTES = 64 * 1024 * 1024

# The formats a prompt's image may be in: the web's and cameras' formats. Others that PIL could
# open are refused, among them EPS (decoded by running Ghostscript) and scientific containers.
FORMATS = ("PNG", "JPEG", "MPO", "WEBP", "GIF", "BMP", "TIFF", "AVIF")

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):")


class ImageError(ValueError):
    """An image that cannot be read: the message names the image, what is wrong and the fix."""


@dataclass(frozen=True)
class ImageLimits:
    """What load_image may read, and how much.

    max_pixels      width * height at most, checked on the header before decoding
    max_bytes       an encoded image's size at most (a file, a download, bytes, a data: URL)
    allow_http      whether http(s) URLs are fetched; off: they are refused (no network access)
    http_timeout_s  a download's deadline, checked between reads; each connect and read also
                    waits at most this long
    base_dir        where relative paths are read from; None: the current directory
    option_prefix   how the caller's user sets these limits, for messages: the job passes
                    "dataset." (dataset.max_image_pixels, ...); the Python API passes ""
    """

    max_pixels: int = DEFAULT_MAX_PIXELS
    max_bytes: int = DEFAULT_MAX_BYTES
    allow_http: bool = False
    http_timeout_s: float = 30.0
    base_dir: Path | None = None
    option_prefix: str = ""

    def __post_init__(self) -> None:
        for name in ("max_pixels", "max_bytes", "http_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"image limit {name} must be positive, not {getattr(self, name)}")

    def option(self, name: str) -> str:
        """The user-facing option `name` (max_image_pixels, max_image_bytes, allow_image_http,
        image_http_timeout_s) as the user writes it."""
        return f"{self.option_prefix}{name}"


def load_image(source: Any, limits: ImageLimits) -> Image.Image:
    """The image `source` names, fully decoded, in RGB (transparency composited onto white, as HF
    image processors do; the first frame of an animation; pixels as stored, no EXIF rotation).

    source: a PIL image; bytes of an encoded image; a dict with "bytes" (used when not None) or
    "path" (HF datasets' Image feature, Parquet image columns); a path (str or os.PathLike,
    relative to limits.base_dir); a file:// URL; a data:image/...;base64, URL; an http(s) URL
    when limits.allow_http. Raises ImageError."""
    if isinstance(source, Image.Image):
        return _finish(source, "the image", limits)
    if isinstance(source, (bytes, bytearray, memoryview)):
        size = source.nbytes if isinstance(source, memoryview) else len(source)
        _check_bytes(size, "the encoded image", limits)  # before copying it
        return _decode(bytes(source), "the encoded image", limits)
    if isinstance(source, dict):
        return _load_cell(source, limits)
    if isinstance(source, os.PathLike):
        return _load_path(Path(source), limits)
    if isinstance(source, str):
        return _load_string(source, limits)
    raise ImageError(
        f"cannot read an image from a {type(source).__name__}; pass a PIL image, encoded image "
        "bytes, a {'bytes', 'path'} dict, a path, or a file:, data: or http(s) URL"
    )


def image_digest(image: Image.Image) -> bytes:
    """sha256 over the image's mode, size and decoded pixels: the same pixels give the same digest
    whatever file format or encoding they came from; any changed pixel changes it. Palette modes
    (P, PA) are refused, their colors not being in the pixels: digest load_image's output."""
    if image.mode in ("P", "PA"):
        raise ValueError(
            f"cannot digest a {image.mode}-mode image (its colors are in a palette): convert it "
            "to RGB first, as load_image does"
        )
    h = hashlib.sha256()
    h.update(f"{image.mode}\n{image.width}x{image.height}\n".encode())
    h.update(image.tobytes())
    return h.digest()


def relative_path(source: Any) -> str | None:
    """The path `source` names when load_image would read it from ImageLimits.base_dir (a
    relative file path, alone or as a {"bytes": None, "path"} cell's), else None (bytes,
    an absolute path, a URL), so that a caller without a folder to read it from can refuse it."""
    if isinstance(source, dict):
        source = source.get("path") if source.get("bytes") is None else None
    if isinstance(source, os.PathLike):
        source = os.fspath(source)
    if not isinstance(source, str):
        return None
    match = _SCHEME.match(source)  # as _load_string tells URLs from paths
    if match and (match.group(1).lower() in ("data", "http", "https", "file") or "://" in source):
        return None
    return None if Path(source).is_absolute() else source


def _load_cell(cell: dict[str, Any], limits: ImageLimits) -> Image.Image:
    if cell.get("bytes") is not None:
        return load_image(cell["bytes"], limits)
    if cell.get("path") is not None:
        return load_image(cell["path"], limits)
    raise ImageError(
        f"an image given as a dict needs a 'bytes' or a 'path' value, and this one has "
        f"{sorted(map(str, cell)) or 'no keys'} with neither set; use the shape of HF datasets' "
        "Image feature: {'bytes': <encoded image>, 'path': <file>}"
    )


def _load_string(text: str, limits: ImageLimits) -> Image.Image:
    match = _SCHEME.match(text)
    scheme = match.group(1).lower() if match else ""
    if scheme == "data":
        return _load_data_url(text, limits)
    if scheme in ("http", "https"):
        return _decode(_fetch(text, limits), f"the image at {text}", limits)
    if scheme == "file":
        parts = urlsplit(text)
        if parts.netloc not in ("", "localhost"):
            raise ImageError(
                f"{text}: a file: URL on another host ({parts.netloc}) cannot be read; use a "
                "file on this machine (file:///path) or a path"
            )
        return _load_path(Path(urllib.request.url2pathname(parts.path)), limits)
    if match and "://" in text:
        raise ImageError(
            f"{text}: {scheme}:// image URLs are not read; use a local path, a file:, data: or "
            "http(s) URL"
        )
    return _load_path(Path(text), limits)


def _load_path(path: Path, limits: ImageLimits) -> Image.Image:
    if not path.is_absolute() and limits.base_dir is not None:
        path = limits.base_dir / path
    what = f"image file {path}"
    try:
        with open(path, "rb") as f:
            _check_bytes(os.fstat(f.fileno()).st_size, what, limits)
            data = f.read(limits.max_bytes + 1)  # bounded even if the file grows meanwhile
    except FileNotFoundError:
        where = "" if path.is_absolute() else " (relative to the current directory)"
        raise ImageError(f"{what} not found{where}; check the path") from None
    except IsADirectoryError:
        raise ImageError(f"{what} is a folder, not an image file; name a file in it") from None
    except OSError as e:
        raise ImageError(f"{what} cannot be read: {e.strerror or e}; check its permissions") from e
    _check_bytes(len(data), what, limits)
    return _decode(data, what, limits)


def _load_data_url(url: str, limits: ImageLimits) -> Image.Image:
    what = f"the data: URL image ({len(url)} characters)"
    header, comma, payload = url.partition(",")
    if not comma:
        raise ImageError(
            f"{what} has no ',' before its data; write it as data:image/png;base64,<data>"
        )
    is_base64 = header.lower().endswith(";base64")
    # Refuse before decoding what cannot decode within the limit: base64 makes 3 bytes of 4
    # characters, less up to 2 of padding; percent-encoding at most 3 characters a byte.
    at_least = len(payload) * 3 // 4 - 2 if is_base64 else len(payload) // 3
    _check_bytes(at_least, what, limits)
    try:
        data = base64.b64decode(payload, validate=True) if is_base64 else unquote_to_bytes(payload)
    except (binascii.Error, ValueError) as e:
        raise ImageError(f"{what} is not valid base64 ({e}); encode the image again") from None
    _check_bytes(len(data), what, limits)
    return _decode(data, what, limits)


class _HttpRedirectsOnly(urllib.request.HTTPRedirectHandler):
    """Follows redirects to http(s) only (urllib's default would also follow one to ftp)."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # type: ignore[no-untyped-def]
        if urlsplit(newurl).scheme.lower() not in ("http", "https"):
            raise urllib.error.HTTPError(
                newurl, code, f"redirect to a non-http URL {newurl}", headers, fp
            )
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _fetch(url: str, limits: ImageLimits) -> bytes:
    what = f"the image at {url}"
    if not limits.allow_http:
        raise ImageError(
            f"{what} is not fetched: http(s) image URLs are off by default; set "
            f"{limits.option('allow_image_http')}=true to fetch them, or download the image and "
            "pass its path"
        )
    deadline = time.monotonic() + limits.http_timeout_s
    request = urllib.request.Request(url, headers={"Accept": "image/*"})
    opener = urllib.request.build_opener(_HttpRedirectsOnly)
    chunks: list[bytes] = []
    size = 0
    try:
        with opener.open(request, timeout=limits.http_timeout_s) as response:
            length = response.headers.get("Content-Length", "")
            if length.isdigit():
                _check_bytes(int(length), what, limits)
            while chunk := response.read1(1 << 16):
                size += len(chunk)
                _check_bytes(size, what, limits)
                chunks.append(chunk)
                if time.monotonic() > deadline:
                    raise TimeoutError("the download took too long")
    except urllib.error.HTTPError as e:
        e.close()  # it holds the response's connection
        raise ImageError(f"{what} could not be fetched: HTTP {e.code} {e.reason}") from None
    except (TimeoutError, urllib.error.URLError) as e:
        # urllib wraps a timeout while connecting in a URLError; one while reading is bare.
        reason = e.reason if isinstance(e, urllib.error.URLError) else e
        if not isinstance(reason, TimeoutError):
            raise ImageError(f"{what} could not be fetched: {reason}; check the URL") from None
        raise ImageError(
            f"{what} did not download within {limits.option('image_http_timeout_s')}="
            f"{limits.http_timeout_s:g} s; raise the limit or download the image and pass its path"
        ) from None
    except (OSError, HTTPException) as e:
        raise ImageError(f"{what} could not be fetched: {e}; check the URL") from None
    return b"".join(chunks)


def _check_bytes(size: int, what: str, limits: ImageLimits) -> None:
    if size > limits.max_bytes:
        raise ImageError(
            f"{what} is over {limits.max_bytes} bytes ({limits.option('max_image_bytes')}="
            f"{limits.max_bytes}); compress or downscale it, or raise the limit"
        )


def _decode(data: bytes, what: str, limits: ImageLimits) -> Image.Image:
    Image.init()  # registers every format plugin, so that FORMATS can be looked up in OPEN
    formats = tuple(f for f in FORMATS if f in Image.OPEN)
    try:
        image = Image.open(io.BytesIO(data), formats=formats)
    except Image.DecompressionBombError as e:
        raise ImageError(_bomb_message(what, e, limits)) from None
    except UnidentifiedImageError:
        raise ImageError(
            f"{what} is not an image in a supported format ({', '.join(formats)}); pass an image "
            "file in one of them"
        ) from None
    # PIL's format plugins raise many exception types on hostile headers; each means the same.
    except Exception as e:
        raise ImageError(f"{what} has a broken image header ({e}); re-encode the image") from None
    return _finish(image, what, limits)


def _finish(image: Image.Image, what: str, limits: ImageLimits) -> Image.Image:
    """Checks the pixel count (from the header: decoding is lazy), decodes, converts to RGB."""
    width, height = image.size
    if width * height > limits.max_pixels:
        raise ImageError(
            f"{what} is {width}x{height} = {width * height / 1e6:.1f} megapixels, more than "
            f"{limits.option('max_image_pixels')}={limits.max_pixels}; downscale it or raise the "
            "limit"
        )
    try:
        image.load()
        return _to_rgb(image)
    except Image.DecompressionBombError as e:
        raise ImageError(_bomb_message(what, e, limits)) from None
    # A truncated or corrupt body fails here, in whatever way the format's decoder fails.
    except Exception as e:
        raise ImageError(
            f"{what} is truncated or corrupt ({e}); re-encode or re-download it"
        ) from None


def _to_rgb(image: Image.Image) -> Image.Image:
    """RGB as HF image processors make it: an image with an alpha band or a transparent color is
    composited onto white, any other mode converted."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    # convert() copies even an RGB image, so the caller's image is never the one returned.
    return image.convert("RGB")


def _bomb_message(what: str, error: Exception, limits: ImageLimits) -> str:
    return (
        f"{what} is refused by PIL's decompression-bomb guard ({error}); downscale it (the "
        f"limit here is {limits.option('max_image_pixels')}={limits.max_pixels} pixels)"
    )
