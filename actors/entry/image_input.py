"""Images a request brings: chat `image_url` content parts and `/generate`'s `image_data`, loaded, checked and put
into the bus's image store (bus/image_store.py), so the request that goes on the bus carries only their handles.

Sources: a `data:image/...;base64,...` URL always; for `/generate` also bare base64; `file://` URLs only under
`--allowed-local-media-path`; `http(s)://` URLs only with `--allow-remote-images` (fetched within
`--remote-image-timeout` seconds). Each image may be at most `--max-image-bytes` long and a request may hold
`--max-images-per-request`. Every image is decoded once here (Pillow) so a corrupt one is a 400 naming where it was
(`messages[0].content[1]`, `image_data[2]`) before anything runs. Whether the model takes images at all is the
tokenizer's answer (it loads the model's processor).

Until `ImageIntake.resolve` runs, a parsed request holds the sources themselves: an image part is
`{"type": "image", "url": <source>}` and `image_data` lists sources; `resolve` replaces each by its handle.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import os
import warnings
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlparse

from ringserve.bus.errors import ApiError, clip
from ringserve.bus.image_store import ImageStore, ImageStoreUnavailable
from ringserve.bus.messages import GenerateRequest

DEFAULT_MAX_IMAGE_BYTES = 10 * 1024 * 1024
DEFAULT_MAX_IMAGES = 8
DEFAULT_REMOTE_TIMEOUT = 10.0
MAX_PIXELS = 64 * 1024 * 1024  # a larger image is refused before it is decoded (a decompression bomb)
DETAILS = ("auto",)  # OpenAI's image_url.detail: the model's processor sets the resolution, so only auto


@dataclass
class ImageLimits:
    """What image sources the entry takes, and how many and how large."""

    max_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    max_images: int = DEFAULT_MAX_IMAGES
    allow_remote: bool = False
    remote_timeout: float = DEFAULT_REMOTE_TIMEOUT
    local_dir: str | None = None  # file URLs under this directory are read; None: no file URLs


def chat_image_parts(content: Any, index: int) -> list[dict[str, str]] | None:
    """The parts of chat message `index`'s content when it holds `image_url` parts (text parts as they are, each
    image as `{"type": "image", "url"}`), else None. Other part types are the text parser's to refuse."""
    if not isinstance(content, list) or not any(isinstance(p, dict) and p.get("type") == "image_url"
                                                for p in content):
        return None
    parts: list[dict[str, str]] = []
    for j, part in enumerate(content):
        where = f"messages[{index}].content[{j}]"
        if part.get("type") == "text":
            parts.append({"type": "text", "text": part["text"]})
            continue
        spec = part.get("image_url")
        url = spec.get("url") if isinstance(spec, dict) else spec
        if not isinstance(url, str) or set(part) - {"type", "image_url"}:
            raise ApiError(f"{where} must be {{\"type\": \"image_url\", \"image_url\": {{\"url\": ...}}}}",
                           param="messages")
        if isinstance(spec, dict):
            unknown = set(spec) - {"url", "detail"}
            if unknown:
                raise ApiError(f"{where}.image_url: unexpected field {clip(sorted(unknown)[0])!r}", param="messages")
            if spec.get("detail") is not None and spec["detail"] not in DETAILS:
                raise ApiError(f"{where}.image_url.detail {clip(str(spec['detail']))!r} is not supported: the "
                               "model's own processor sets the resolution (only \"auto\")", param="messages")
        parts.append({"type": "image", "url": url})
    return parts


def image_data_sources(value: Any, prompts: int, batch: bool) -> list[list[str] | None]:
    """`/generate`'s `image_data` as the sources of each of `prompts` prompts: one source or a list for one
    prompt; for a batch, a list with one entry (a source, a list, or null) per prompt."""
    if value is None:
        return [None] * prompts
    if not batch:
        return [_source_list(value, "image_data")]
    if not isinstance(value, list) or len(value) != prompts:
        raise ApiError(f"image_data must be a list with one entry per prompt ({prompts}) for a batch",
                       param="image_data")
    return [None if v is None else _source_list(v, f"image_data[{p}]") for p, v in enumerate(value)]


def _source_list(value: Any, where: str) -> list[str]:
    sources = [value] if isinstance(value, str) else value
    if not isinstance(sources, list) or not sources or not all(isinstance(s, str) for s in sources):
        raise ApiError(f"{where} must be an image (base64 or a data URL) or a non-empty list of them",
                       param="image_data")
    return sources


class ImageIntake:
    """Loads, checks and stores the images of parsed requests (`resolve`)."""

    def __init__(self, store: ImageStore, limits: ImageLimits | None = None) -> None:
        self.store = store
        self.limits = limits or ImageLimits()

    async def resolve_all(self, gen_reqs: list[GenerateRequest], batch: bool = False) -> None:
        """`resolve` each of a response's prompts (`batch`: their `image_data` came as one list per prompt)."""
        for p, gen_req in enumerate(gen_reqs):
            await self.resolve(gen_req, f"image_data[{p}]" if batch else "image_data")

    async def resolve(self, gen_req: GenerateRequest, data_where: str = "image_data") -> None:
        """Replace the image sources in `gen_req` (its messages' image parts, its `image_data`) by the handles of
        the stored images. ApiError 400 naming the image for a source not allowed, too large or corrupt, or more
        images than `max_images`; 503 when the store cannot be reached."""
        wanted: list[tuple[dict[str, str] | None, int, str, str, str]] = []  # (part, index, source, where, param)
        for i, turn in enumerate(gen_req.messages or []):
            for j, part in enumerate(turn.parts or []):
                if part.get("type") == "image":  # a route may say where the client put it (Anthropic's names)
                    where = part.pop("where", None) or f"messages[{i}].content[{j}]"
                    wanted.append((part, j, part.get("url", ""), where, "input" if where.startswith("input") else
                                   "messages"))
        for k, source in enumerate(gen_req.image_data or []):
            wanted.append((None, k, source, f"{data_where}[{k}]", "image_data"))
        if len(wanted) > self.limits.max_images:
            raise ApiError(f"the request holds {len(wanted)} images; this server takes at most "
                           f"{self.limits.max_images} per request (--max-images-per-request)", param=wanted[0][4])
        handles: dict[str, str] = {}
        for part, k, source, where, param in wanted:
            if source not in handles:
                data = await self.load(source, where, param, bare_base64=part is None)
                try:
                    handles[source] = await self.store.put_raw(data)
                except ImageStoreUnavailable as exc:
                    raise ApiError(str(exc), 503, type="server_error") from exc
            if part is not None:
                part.pop("url", None)
                part["handle"] = handles[source]
            else:
                assert gen_req.image_data is not None
                gen_req.image_data[k] = handles[source]

    async def load(self, source: str, where: str, param: str, bare_base64: bool = False) -> bytes:
        """The checked bytes of one image source; ApiError 400 naming `where` when they cannot be used."""
        scheme = source[:source.find(":")].lower() if ":" in source[:12] else ""
        if scheme == "data":
            data = _data_url(source, where, param)
        elif scheme == "file":
            data = await asyncio.to_thread(self._local_file, source, where, param)
        elif scheme in ("http", "https"):
            data = await self._remote(source, where, param)
        elif bare_base64 and not scheme:
            data = _base64(source, where, param)
        else:
            forms = "base64, a data URL" if bare_base64 else "a data URL (data:image/...;base64,...)"
            raise ApiError(f"{where}: an image must be {forms}, or an http(s) or file URL where the server allows "
                           "them", param=param)
        if len(data) > self.limits.max_bytes:
            raise ApiError(f"{where}: the image is {len(data)} bytes; this server takes images up to "
                           f"{self.limits.max_bytes} bytes (--max-image-bytes)", param=param)
        await asyncio.to_thread(check_decodes, data, where, param)
        return data

    def _local_file(self, url: str, where: str, param: str) -> bytes:
        if self.limits.local_dir is None:
            raise ApiError(f"{where}: file URLs are not allowed on this server (start it with "
                           "--allowed-local-media-path DIR to read images under DIR)", param=param)
        parsed = urlparse(url)
        if parsed.netloc not in ("", "localhost"):
            raise ApiError(f"{where}: a file URL must name a local path (file:///...)", param=param)
        root = os.path.realpath(self.limits.local_dir)
        path = os.path.realpath(unquote(parsed.path))
        if os.path.commonpath([root, path]) != root:
            raise ApiError(f"{where}: {clip(url)} is not under the allowed media directory", param=param)
        try:
            with open(path, "rb") as f:
                return f.read(self.limits.max_bytes + 1)
        except OSError as exc:
            raise ApiError(f"{where}: cannot read {clip(url)}: {exc.strerror}", param=param) from exc

    async def _remote(self, url: str, where: str, param: str) -> bytes:
        if not self.limits.allow_remote:
            raise ApiError(f"{where}: http(s) image URLs are not allowed on this server (start it with "
                           "--allow-remote-images to fetch them; or send the image as a data URL)", param=param)
        import httpx

        data = bytearray()

        async def fetch() -> None:
            async with httpx.AsyncClient(timeout=self.limits.remote_timeout, follow_redirects=True) as client:
                async with client.stream("GET", url) as response:
                    if response.status_code != 200:
                        raise ApiError(f"{where}: fetching {clip(url)} answered HTTP {response.status_code}",
                                       param=param)
                    async for chunk in response.aiter_bytes():
                        data.extend(chunk)
                        if len(data) > self.limits.max_bytes:
                            return

        try:
            await asyncio.wait_for(fetch(), self.limits.remote_timeout)
        except (httpx.HTTPError, asyncio.TimeoutError) as exc:
            raise ApiError(f"{where}: fetching {clip(url)} failed: {exc!r}"[:500], param=param) from exc
        return bytes(data)


def _data_url(url: str, where: str, param: str) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep or not header.lower().endswith(";base64"):
        raise ApiError(f"{where}: a data URL must be data:<type>;base64,<data>", param=param)
    return _base64(payload, where, param)


def _base64(text: str, where: str, param: str) -> bytes:
    try:
        return base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ApiError(f"{where}: the image is not valid base64: {exc}", param=param) from exc


def check_decodes(data: bytes, where: str, param: str) -> None:
    """ApiError 400 naming `where` unless `data` is an image Pillow decodes whole, of at most MAX_PIXELS."""
    from PIL import Image

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as image:
                width, height = image.size
                if width * height > MAX_PIXELS:
                    raise ApiError(f"{where}: the image is {width}x{height} pixels; at most {MAX_PIXELS} are "
                                   "taken", param=param)
                image.load()
    except ApiError:
        raise
    except Exception as exc:  # Pillow raises many types for a bad file
        raise ApiError(f"{where}: the image cannot be decoded: {clip(str(exc) or type(exc).__name__)}",
                       param=param) from exc

