"""OpenAI-style chat messages -> the plain {role, content} turns a chat template renders.

Shared by the dataset rows, OpenAI Batch lines and LLM.chat, so that a conversation means the
same thing everywhere: content is a string or a list of text parts (joined with a newline, as
vLLM does for string-content templates), and the role is one that templates know. A role
outside that set is refused rather than rendered: most templates would print it verbatim as a
turn the model was never trained on.

For a vision-language model (`images` given), content may hold image parts too: OpenAI's
{"type": "image_url", "image_url": {"url": ...}}, vLLM's {"type": "image_pil", "image_pil": ...}
and HF's {"type": "image", "image" | "url" | "path": ...}. Each one's source goes to `images` in
order, and the message's content becomes the parts VLM templates iterate over: text parts and
bare {"type": "image"} parts, where the template writes the family's placeholder.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

ROLES = ("system", "developer", "user", "assistant", "tool")


# Image part type -> the keys that may hold its image (the first one present is taken). A
# bare {"type": "image"} is an image placed already (a normalised message's).
_IMAGE_SOURCES = {
    "image_url": ("image_url",),
    "image_pil": ("image_pil",),
    "image": ("image", "url", "path"),
}


def normalize_messages(value: Any, images: list[Any] | None = None) -> list[dict[str, Any]]:
    """The conversation as [{role, content}, ...], content a str, or (a message with images, for
    a vision model: `images` given, each image's source appended to it) a list of text parts
    and {"type": "image"} parts; ValueError naming the bad message. Normalised messages come
    back as they are."""
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence) or not value:
        what = "empty" if isinstance(value, Sequence) and not value else type(value).__name__
        raise ValueError(f"messages must be a non-empty list of {{role, content}} (got {what})")
    return [_message(i, m, images) for i, m in enumerate(value)]


def _message(i: int, m: Any, images: list[Any] | None) -> dict[str, Any]:
    if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or not m["role"]:
        raise ValueError(f"messages[{i}] is not a {{role: str, content: str}} object")
    role = m["role"]
    if role not in ROLES:
        raise ValueError(
            f"messages[{i}] has role {role!r}; use one of {', '.join(ROLES)} "
            "(map other names, e.g. human/gpt, to user/assistant)"
        )
    return {"role": role, "content": _content(i, m.get("content"), images)}


def _content(i: int, content: Any, images: list[Any] | None) -> str | list[dict[str, str]]:
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence) and not isinstance(content, bytes) and content:
        parts: list[dict[str, str]] = []
        for j, part in enumerate(content):
            if isinstance(part, str):
                parts.append({"type": "text", "text": part})
                continue
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind == "text" and isinstance(part.get("text"), str):
                parts.append({"type": "text", "text": part["text"]})
            elif kind == "image" and len(part) == 1:
                parts.append({"type": "image"})  # placed already (a normalised message)
            elif kind in _IMAGE_SOURCES and images is not None:
                images.append(_image_source(i, j, kind, part))
                parts.append({"type": "image"})
            else:
                got = f"type {kind!r}" if kind else type(part).__name__
                if kind in _IMAGE_SOURCES:
                    problem = "is an image part, and this model takes no images"
                    how = "use a vision-language model, or send text parts only"
                else:
                    problem = "is not a text or image part"
                    how = 'give {"type": "text", "text": ...} parts (or image parts)'
                raise ValueError(f"messages[{i}].content[{j}] {problem} ({got}): {how}")
        if any(p["type"] == "image" for p in parts):
            return parts
        return "\n".join(p["text"] for p in parts)
    raise ValueError(
        f"messages[{i}] is not a {{role: str, content: str}} object: content must be text or "
        f"a list of text parts (got {type(content).__name__})"
    )


def _image_source(i: int, j: int, kind: str, part: Mapping[str, Any]) -> Any:
    """The image an image part names: a URL, a path, bytes or a PIL image, as given."""
    for key in _IMAGE_SOURCES[kind]:
        value = part.get(key)
        if kind == "image_url" and isinstance(value, Mapping):
            value = value.get("url")
        if value is not None:
            return value
    keys = ", ".join(_IMAGE_SOURCES[kind])
    raise ValueError(f"messages[{i}].content[{j}] is a {kind} part without its image ({keys})")
