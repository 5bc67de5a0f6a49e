"""The "K questions per image" workload of jobs/bench/images.py: N distinct images (crops and
rescales of scikit-image's bundled photographs, and generated pictures) and K questions about
each, as the model family's prompts (TEMPLATES) in job order (an image's K questions adjacent),
and the prompt tokens a prefix cache can save on it at best."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image, ImageOps

# skimage.data's pictures that ship inside the package (no download), photographs and scans;
# greyscale ones are made RGB.
PHOTOS = ("astronaut", "chelsea", "coffee", "rocket", "hubble_deep_field",
          "immunohistochemistry", "retina", "camera", "coins", "moon", "clock", "page", "brick",
          "grass", "gravel", "text")  # fmt: skip
QUESTIONS = (
    "What is shown in this image?",
    "Describe the colors you see.",
    "How many distinct objects are there?",
    "Was this taken indoors or outdoors?",
    "Write a one-line caption for it.",
    "What is in the background?",
    "What is the main subject doing?",
    "What mood does this picture convey?",
)
# Each family's prompt of one image and a question: LLaVA-1.5's; SmolVLM's chat template's
# rendering of a user turn of an image and text, then the assistant's turn.
TEMPLATES = {
    "llava": "USER: <image>\n{question} ASSISTANT:",
    "idefics3": "<|im_start|>User:<image>{question}<end_of_utterance>\nAssistant:",
}
GENERATED_EVERY = 4  # every 4th image is generated, the others photographs' variants


@dataclass(frozen=True)
class ImageJob:
    """images[i] is named names[i]; row r asks questions[q] about images[i] for (i, q) =
    rows[r], its prompt text texts[r] (`template` with the question)."""

    images: list[Image.Image]
    names: list[str]
    questions: list[str]
    rows: list[tuple[int, int]]
    texts: list[str]
    template: str

    def prompts(self) -> list[dict[str, Any]]:
        """vLLM's prompt dicts, one per row, in job order."""
        return [{"prompt": t, "multi_modal_data": {"image": self.images[i]}}
                for t, (i, _) in zip(self.texts, self.rows, strict=True)]  # fmt: skip

    def row_images(self) -> list[Image.Image]:
        return [self.images[i] for i, _ in self.rows]

    def description(self) -> str:
        photos = sum(not n.startswith("generated") for n in self.names)
        return (f"{len(self.images)} distinct images ({photos} crops/rescales of scikit-image "
                f"photographs, {len(self.images) - photos} generated) x {len(self.questions)} "
                f"questions each = {len(self.rows)} prompts, image-major job order, prompt "
                f"{self.template!r}")  # fmt: skip


def questions(k: int) -> list[str]:
    """K distinct questions: the bank in order, then again marked by round."""
    return [QUESTIONS[j % len(QUESTIONS)] + ("" if j < len(QUESTIONS) else
            f" (round {j // len(QUESTIONS) + 1})") for j in range(k)]  # fmt: skip


def photographs() -> list[tuple[str, np.ndarray]]:
    """(name, RGB uint8 array) of each of PHOTOS."""
    import skimage.data

    out = []
    for name in PHOTOS:
        pixels = getattr(skimage.data, name)()
        out.append((name, np.asarray(Image.fromarray(pixels).convert("RGB"))))
    return out


def photo_variant(photo: np.ndarray, rng: np.random.Generator) -> Image.Image:
    """A random crop (half to all of each side) rescaled by 0.5..1.5, mirrored half the time."""
    h, w = photo.shape[:2]
    ch, cw = int(h * rng.uniform(0.5, 1.0)), int(w * rng.uniform(0.5, 1.0))
    y, x = int(rng.integers(0, h - ch + 1)), int(rng.integers(0, w - cw + 1))
    image = Image.fromarray(photo[y : y + ch, x : x + cw])
    scale = rng.uniform(0.5, 1.5)
    image = image.resize((max(32, int(cw * scale)), max(32, int(ch * scale))),
                         Image.Resampling.BICUBIC)  # fmt: skip
    return ImageOps.mirror(image) if rng.random() < 0.5 else image


def generated_image(kind: int, rng: np.random.Generator) -> Image.Image:
    """A gradient, rings or stripes of random colours and frequency over noise, of random size."""
    h, w = (int(v) for v in rng.integers(96, 480, 2))
    ys, xs = np.mgrid[0:h, 0:w].astype(np.float32)
    ys, xs = ys / h, xs / w
    if kind % 3 == 0:
        field = xs * rng.uniform(0.2, 1) + ys * rng.uniform(0.2, 1)
    elif kind % 3 == 1:
        cy, cx = rng.uniform(0, 1, 2)
        field = 0.5 + 0.5 * np.sin(np.hypot(ys - cy, xs - cx) * rng.uniform(10, 60))
    else:
        field = 0.5 + 0.5 * np.sign(np.sin((xs * rng.uniform(-1, 1) + ys) * rng.uniform(5, 40)))
    low, high = rng.uniform(0, 255, (2, 3))
    pixels = low + field[..., None] * (high - low) + rng.normal(0, 12, (h, w, 3))
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


def workload_images(n: int, seed: int = 0) -> tuple[list[Image.Image], list[str]]:
    """n distinct RGB images and their names. Raises ValueError if two came out equal."""
    rng = np.random.default_rng(seed)
    photos = photographs()
    images, names, used = [], [], 0
    for i in range(n):
        if i % GENERATED_EVERY == GENERATED_EVERY - 1:
            kind = ("gradient", "rings", "stripes")[i % 3]
            images.append(generated_image(i, rng))
            names.append(f"generated {kind} {i}")
        else:
            name, photo = photos[used % len(photos)]
            images.append(photo_variant(photo, rng))
            names.append(f"{name} variant {used // len(photos) + 1}")
            used += 1
    digests = {hashlib.sha256(im.tobytes() + repr(im.size).encode()).digest() for im in images}
    if len(digests) != n:
        raise ValueError(f"{n - len(digests)} of the {n} images are duplicates: another --seed")
    return images, names


def image_job(n: int, k: int, template: str, seed: int = 0) -> ImageJob:
    """n images x k questions, an image's questions adjacent (the job's order), each prompt
    `template` (a value of TEMPLATES) with its question."""
    images, names = workload_images(n, seed)
    asked = questions(k)
    rows = [(i, q) for i in range(n) for q in range(k)]
    texts = [template.format(question=asked[q]) for _, q in rows]
    return ImageJob(images, names, asked, rows, texts, template)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def shareable_tokens(prompt_ids: Sequence[Sequence[int]], images: Sequence[int], block: int) -> int:
    """The prompt tokens a block-sized prefix cache keyed by image content saves at best: within
    each image's rows (their tokens in sorted order, so each follows the one it shares most
    with), each row after the first reuses its common prefix with the previous one, in whole
    blocks, short of its last token (which is always computed). Rows of different images share
    nothing past the image's first token, and the text before it is under a block."""
    groups: dict[int, list[Sequence[int]]] = {}
    for ids, image in zip(prompt_ids, images, strict=True):
        groups.setdefault(image, []).append(ids)
    saved = 0
    for rows in groups.values():
        rows = sorted(rows, key=list)
        for prev, ids in zip(rows, rows[1:], strict=False):
            saved += min(common_prefix(prev, ids), len(ids) - 1) // block * block
    return saved
