"""load_image and image_digest (issue #72): every source kind gives the pixels of the photograph
it holds (scikit-image's astronaut, as numpy holds it, is the reference); RGB conversion is
transformers' own convert_to_rgb; the digest follows the pixels, not the encoding; and every bad
image (truncated, not an image, a refused format, too many pixels claimed by its header, a
missing file, too many bytes, a URL not allowed, a slow or failing server) is an ImageError that
says what is wrong. http(s) is served by a local http.server on 127.0.0.1, nothing else."""

from __future__ import annotations

import base64
import contextlib
import gc
import io
import struct
import threading
import time
import warnings
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from batchpage.data.images import ImageError, ImageLimits, image_digest, load_image
from tests.extras import require

skimage_data = require("skimage.data", "dev")


@pytest.fixture(scope="module")
def photo() -> np.ndarray:
    return skimage_data.astronaut()  # 512x512 RGB uint8


def encode(array_or_image: np.ndarray | Image.Image, fmt: str, **kw: object) -> bytes:
    image = (
        array_or_image
        if isinstance(array_or_image, Image.Image)
        else Image.fromarray(array_or_image)
    )
    buf = io.BytesIO()
    image.save(buf, fmt, **kw)
    return buf.getvalue()


def png_header(width: int, height: int) -> bytes:
    """A PNG whose IHDR claims width x height (8-bit RGB) and whose data is a few bytes: what a
    decompression bomb's header looks like before anything is decoded."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(kind + body)
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\0" * 64)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


# --- every source kind ----------------------------------------------------------------------


@dataclass
class Route:
    body: bytes = b""
    status: int = 200
    content_length: bool = True
    delay_s: float = 0.0
    location: str = ""


@dataclass
class Server:
    url: str
    routes: dict[str, Route] = field(default_factory=dict)
    requests: list[str] = field(default_factory=list)


@pytest.fixture
def http(monkeypatch: pytest.MonkeyPatch) -> Iterator[Server]:
    """A local HTTP server on 127.0.0.1 serving `routes`; the requests it got in `requests`."""
    for name in (
        "http_proxy",
        "https_proxy",
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "ALL_PROXY",
        "all_proxy",
    ):
        monkeypatch.delenv(name, raising=False)
    state = Server("")

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            state.requests.append(self.path)
            route = state.routes.get(self.path, Route(status=404))
            time.sleep(route.delay_s)
            self.send_response(route.status)
            if route.location:
                self.send_header("Location", route.location)
            if route.content_length:
                self.send_header("Content-Length", str(len(route.body)))
            self.end_headers()
            # The client may stop reading: what a size bound does.
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                self.wfile.write(route.body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    state.url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_every_source_kind_gives_the_photographs_pixels(
    photo: np.ndarray, tmp_path: Path, http: Server
) -> None:
    png = encode(photo, "PNG")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a b.png").write_bytes(png)
    http.routes["/a.png"] = Route(png)
    http.routes["/chunked.png"] = Route(png, content_length=False)
    data_url = "data:image/png;base64," + base64.b64encode(png).decode()
    limits = ImageLimits(base_dir=tmp_path, allow_http=True)
    sources = {
        "PIL image": Image.fromarray(photo),
        "PIL image, lazily opened": Image.open(io.BytesIO(png)),
        "bytes": png,
        "bytearray": bytearray(png),
        "memoryview": memoryview(png),
        "HF cell with bytes": {"bytes": png, "path": "not/read.png"},
        "HF cell with a path": {"bytes": None, "path": "sub/a b.png"},
        "relative path": "sub/a b.png",
        "absolute Path": tmp_path / "sub" / "a b.png",
        "file URL": (tmp_path / "sub" / "a b.png").as_uri(),
        "data URL": data_url,
        "http URL": f"{http.url}/a.png",
        "http URL, no Content-Length": f"{http.url}/chunked.png",
    }
    for name, source in sources.items():
        image = load_image(source, limits)
        assert image.mode == "RGB", name
        np.testing.assert_array_equal(np.asarray(image), photo, err_msg=name)


def test_the_callers_image_is_not_the_one_returned(photo: np.ndarray) -> None:
    given = Image.fromarray(photo)
    loaded = load_image(given, ImageLimits())
    loaded.putpixel((0, 0), (1, 2, 3))
    np.testing.assert_array_equal(np.asarray(given), photo)


def test_rgb_conversion_is_transformers(photo: np.ndarray) -> None:
    from transformers.image_transforms import convert_to_rgb

    rng = np.random.default_rng(0)
    alpha = rng.integers(0, 256, photo.shape[:2], dtype=np.uint8)
    rgba = Image.fromarray(np.dstack([photo, alpha]))
    palette = Image.fromarray(photo).convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
    palette_clear = palette.copy()
    palette_clear.info["transparency"] = 3
    images = {
        "RGBA": rgba,
        "LA": rgba.convert("LA"),
        "L": rgba.convert("L"),
        "P": palette,
        "P with a transparent color": palette_clear,
        "CMYK": Image.fromarray(photo).convert("CMYK"),
        "1": rgba.convert("1"),
        "RGBA as PNG": Image.open(io.BytesIO(encode(rgba, "PNG"))),
        "P with transparency as GIF": Image.open(io.BytesIO(encode(palette_clear, "GIF"))),
    }
    for name, image in images.items():
        expected = convert_to_rgb(image.copy(), return_numpy=True)
        got = load_image(image, ImageLimits())
        assert got.mode == "RGB", name
        np.testing.assert_array_equal(np.asarray(got), expected, err_msg=name)
    # The white background shows through where the alpha is 0.
    clear = Image.new("RGBA", (2, 2), (10, 20, 30, 0))
    assert load_image(clear, ImageLimits()).getpixel((0, 0)) == (255, 255, 255)


# --- the digest -----------------------------------------------------------------------------


def test_digest_follows_pixels_not_encoding(photo: np.ndarray) -> None:
    lossless = {
        fmt: encode(photo, fmt, **kw)
        for fmt, kw in [("PNG", {}), ("BMP", {}), ("TIFF", {}), ("WEBP", {"lossless": True})]
    }
    assert len(set(lossless.values())) == len(lossless)  # four different encodings
    digests = {fmt: image_digest(load_image(data, ImageLimits())) for fmt, data in lossless.items()}
    digests["array"] = image_digest(Image.fromarray(photo))
    assert len(set(digests.values())) == 1, digests
    assert len(digests["PNG"]) == 32

    changed = photo.copy()
    changed[100, 200, 1] ^= 1  # one channel of one pixel, by one
    assert image_digest(load_image(encode(changed, "PNG"), ImageLimits())) != digests["PNG"]
    # The same bytes as another shape are another image.
    flat = photo.reshape(256, 1024, 3)
    assert flat.tobytes() == photo.tobytes()
    assert image_digest(Image.fromarray(flat)) != digests["PNG"]
    # Lossy JPEG's pixels differ from the original's, and so does its digest.
    jpeg = load_image(encode(photo, "JPEG", quality=90), ImageLimits())
    assert image_digest(jpeg) != digests["PNG"]


def test_digest_refuses_palette_images(photo: np.ndarray) -> None:
    palette = Image.fromarray(photo).convert("P")
    with pytest.raises(ValueError, match="palette"):
        image_digest(palette)
    image_digest(load_image(palette, ImageLimits()))  # what load_image returns is RGB


# --- bad images -----------------------------------------------------------------------------


def refused(source: object, limits: ImageLimits, *phrases: str) -> str:
    with pytest.raises(ImageError) as info:
        load_image(source, limits)
    message = str(info.value)
    for phrase in phrases:
        assert phrase in message, message
    return message


def test_truncated_and_corrupt_images_are_image_errors(photo: np.ndarray, tmp_path: Path) -> None:
    png, jpeg = encode(photo, "PNG"), encode(photo, "JPEG")
    limits = ImageLimits(base_dir=tmp_path)
    refused(png[: len(png) // 2], limits, "truncated or corrupt", "re-")
    refused(jpeg[: len(jpeg) // 2], limits, "truncated or corrupt")
    (tmp_path / "cut.png").write_bytes(png[:-2000])
    refused("cut.png", limits, str(tmp_path / "cut.png"), "truncated or corrupt")
    corrupt = bytearray(png)
    corrupt[len(png) // 2 : len(png) // 2 + 64] = bytes(64)  # a zeroed run inside IDAT
    refused(bytes(corrupt), limits, "truncated or corrupt")


def test_non_images_and_other_formats_are_refused(photo: np.ndarray, tmp_path: Path) -> None:
    limits = ImageLimits(base_dir=tmp_path)
    refused(b"just some text", limits, "not an image", "PNG", "JPEG")
    (tmp_path / "notes.txt").write_text("hello")
    refused("notes.txt", limits, "notes.txt", "not an image")
    refused(b"", limits, "not an image")
    # Formats PIL reads but prompts may not carry: EPS would run Ghostscript.
    refused(b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n", limits, "not an image")
    for fmt in ("TGA", "PCX", "SGI"):
        data = encode(photo, fmt)
        assert Image.open(io.BytesIO(data)).format == fmt  # PIL itself reads it
        refused(data, limits, "not an image")


def test_pixel_limit_is_checked_on_the_header(photo: np.ndarray) -> None:
    # 81 megapixels claimed, above the default limit and below PIL's own guard: refused by the
    # limit before decoding (decoding these few bytes would report them truncated instead).
    message = refused(png_header(9000, 9000), ImageLimits(), "9000x9000", "81.0 megapixels")
    assert f"max_image_pixels={64 * 1024 * 1024}" in message
    assert "downscale" in message
    # Past PIL's decompression-bomb guard, which fires inside Image.open.
    refused(png_header(20000, 20000), ImageLimits(), "decompression-bomb", "max_image_pixels")
    # A real image over a small limit, named as the job's option.
    small = ImageLimits(max_pixels=512 * 511, option_prefix="dataset.")
    refused(encode(photo, "PNG"), small, "512x512", f"dataset.max_image_pixels={512 * 511}")
    refused(Image.fromarray(photo), small, "512x512")
    assert load_image(encode(photo, "PNG"), ImageLimits(max_pixels=512 * 512)).size == (512, 512)


def test_missing_files_and_folders(tmp_path: Path) -> None:
    limits = ImageLimits(base_dir=tmp_path)
    refused("nope.png", limits, str(tmp_path / "nope.png"), "not found")
    refused({"bytes": None, "path": "nope.png"}, limits, "not found")
    refused((tmp_path / "gone.png").as_uri(), limits, "not found")
    refused(str(tmp_path), limits, "is a folder")
    refused("nope.png", ImageLimits(), "relative to the current directory")


def test_byte_limit(photo: np.ndarray, tmp_path: Path) -> None:
    png = encode(photo, "PNG")
    (tmp_path / "a.png").write_bytes(png)
    under = ImageLimits(max_bytes=len(png), base_dir=tmp_path)
    over = ImageLimits(max_bytes=len(png) - 1, base_dir=tmp_path, option_prefix="dataset.")
    data_url = "data:image/png;base64," + base64.b64encode(png).decode()
    for source in (png, "a.png", data_url):
        assert load_image(source, under).size == (512, 512)
        refused(source, over, f"dataset.max_image_bytes={len(png) - 1}")


def test_other_bad_sources() -> None:
    limits = ImageLimits()
    refused("s3://bucket/a.png", limits, "s3://", "not read")
    refused("file://otherhost/a.png", limits, "another host")
    refused(1.5, limits, "float")
    refused({"path": None}, limits, "'bytes' or a 'path'")
    refused("data:image/png;base64,@@@not base64@@@", limits, "not valid base64")
    refused("data:image/png;base64", limits, "no ','")
    with pytest.raises(ValueError, match="max_pixels"):
        ImageLimits(max_pixels=0)


# --- http(s) --------------------------------------------------------------------------------


def test_http_is_refused_unless_allowed(photo: np.ndarray, http: Server) -> None:
    http.routes["/a.png"] = Route(encode(photo, "PNG"))
    url = f"{http.url}/a.png"
    refused(url, ImageLimits(), "allow_image_http=true")
    refused(url.replace("http:", "https:"), ImageLimits(), "allow_image_http")
    refused({"bytes": None, "path": url}, ImageLimits(option_prefix="dataset."), "dataset.allow")
    assert http.requests == []  # refused without a connection
    np.testing.assert_array_equal(np.asarray(load_image(url, ImageLimits(allow_http=True))), photo)
    assert http.requests == ["/a.png"]


def test_http_size_time_and_status_bounds(photo: np.ndarray, http: Server) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        http_bounds(photo, http)
        gc.collect()
    assert not [str(w.message) for w in caught if w.category is ResourceWarning]  # all closed


def http_bounds(photo: np.ndarray, http: Server) -> None:
    png = encode(photo, "PNG")
    http.routes["/a.png"] = Route(png)
    http.routes["/stream.png"] = Route(png * 8, content_length=False)
    http.routes["/slow.png"] = Route(png, delay_s=2.0)
    http.routes["/hop.png"] = Route(status=302, location="ftp://127.0.0.1/a.png")
    allowed = ImageLimits(allow_http=True, max_bytes=len(png) - 1, http_timeout_s=0.5)
    # Refused by the Content-Length, and without it after reading just past the limit.
    refused(f"{http.url}/a.png", allowed, "max_image_bytes")
    refused(f"{http.url}/stream.png", allowed, "max_image_bytes")
    start = time.monotonic()
    refused(f"{http.url}/slow.png", allowed, "did not download within", "0.5 s")
    assert time.monotonic() - start < 1.9
    refused(f"{http.url}/missing.png", allowed, "HTTP 404")
    refused(f"{http.url}/hop.png", allowed, "could not be fetched", "non-http")
    free_port = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    port = free_port.server_address[1]
    free_port.server_close()
    refused(f"http://127.0.0.1:{port}/a.png", allowed, "could not be fetched")
