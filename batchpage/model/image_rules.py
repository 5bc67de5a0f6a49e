"""What one image placeholder token of a prompt becomes, per vision-language family: the token ids
that replace it and which of them take the image's encoder rows, as the family's HF processor
expands it.

A rule is built once per model (`REPLACEMENT_RULES[family](vision, tokenizer)`) and called with
each image's image-processor outputs. LLaVA's is a run of placeholders, as is Qwen2.5-VL's (as
many as the image's size makes); Idefics3's / SmolVLM's is
text around each tile's placeholders (`<fake_token_around_image>`, `<row_i_col_j>`, newlines,
`<global-img>`), tokenized by the model's own tokenizer, so the ids are the ones HF's processor
gets by tokenizing its expanded prompt (the expansion starts and ends with an added token, so
its text tokenizes alike alone and inside a prompt). Gemma 3's starts and ends with a blank line
("\\n\\n"), which Gemma's tokenizer merges with the newlines next to it (a run of newlines is one
token): its rule's `join` re-encodes each run of newline tokens where the expansion meets the
prompt's text, so the ids are again HF's processor's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import torch

from batchpage.model.idefics3 import real_tiles

if TYPE_CHECKING:
    from batchpage.model.tokenizer import Tokenizer
    from batchpage.model.vision_config import VisionConfig


class Replacement(NamedTuple):
    """What one placeholder token becomes: `ids`, of which those at offsets `rows` (in encoder
    row order) take the image's encoder rows."""

    ids: tuple[int, ...]
    rows: tuple[int, ...]


class ReplacementRule(Protocol):
    """A family's rule for one model."""

    # What the image processor is called with besides the image and return_tensors="pt".
    processor_kwargs: Mapping[str, Any]

    def __call__(self, outputs: Mapping[str, Any]) -> Replacement:
        """One image's image-processor outputs -> its placeholder's replacement. Raises
        ValueError when the outputs do not fit the model."""
        ...

    def join(self, ids: list[int], more: Sequence[int]) -> None:
        """ids extended by `more` (the prompt's text and the replacements, in turn), as the
        model's tokenizer tokenizes their texts joined: a change, if any, only to the tokens
        on both sides of the seam that the family's expansion begins or ends with."""
        ...


class PlainJoin:
    """A rule whose expansion tokenizes alike alone and inside a prompt: joins are appends."""

    def join(self, ids: list[int], more: Sequence[int]) -> None:
        ids.extend(more)


# Builds a family's rule from the model's VisionConfig and its tokenizer (called only by the
# rules that need it: a folder without one still places LLaVA's images).
RuleBuilder = Callable[["VisionConfig", Callable[[], "Tokenizer"]], ReplacementRule]


class LlavaRule(PlainJoin):
    """LLaVA: tokens_per_image placeholders, every one an encoder row; the processor's image must
    make that many patch rows in the CLIP tower (the CLS row too with feature_select "full")."""

    processor_kwargs: Mapping[str, Any] = {}

    def __init__(self, vision: VisionConfig) -> None:
        self.vision = vision

    @classmethod
    def build(cls, vision: VisionConfig, tokenizer: Callable[[], Tokenizer]) -> LlavaRule:
        return cls(vision)

    def __call__(self, outputs: Mapping[str, Any]) -> Replacement:
        vision = self.vision
        height, width = outputs["pixel_values"].shape[-2:]
        rows = (height // vision.patch_size) * (width // vision.patch_size)
        rows += vision.feature_select == "full"
        if rows != vision.tokens_per_image:
            raise ValueError(
                f"the image processor makes {height}x{width} pixel values, {rows} rows of the "
                f"vision tower (patch_size={vision.patch_size}), but an image takes "
                f"tokens_per_image={vision.tokens_per_image}: preprocessor_config.json's "
                f"crop_size must match config.json's vision_config image_size={vision.image_size}"
            )
        n = vision.tokens_per_image
        return Replacement((vision.image_token_id,) * n, tuple(range(n)))


class Idefics3Strings(NamedTuple):
    """The texts of Idefics3's expansion (SmolVLM's tokenizer may rename them)."""

    fake: str  # around each tile: <fake_token_around_image>
    image: str  # one encoder row: <image>
    whole: str  # before the downscaled whole image: <global-img>

    @classmethod
    def of(cls, hf_tokenizer: Any) -> Idefics3Strings:
        """The names HF's SmolVLM processor reads from the tokenizer (Idefics3's fixed ones
        when the tokenizer names none)."""
        return cls(
            str(getattr(hf_tokenizer, "fake_image_token", None) or "<fake_token_around_image>"),
            str(getattr(hf_tokenizer, "image_token", None) or "<image>"),
            str(getattr(hf_tokenizer, "global_image_token", None) or "<global-img>"),
        )

    def expansion(self, rows: int, cols: int, per_tile: int) -> str:
        """The text one <image> becomes: each of the rows x cols tiles as
        `<fake><row_r_col_c>` and its placeholders, a newline after each row of tiles, then a
        newline and the whole image `<fake><global-img>` placeholders `<fake>`; the whole image
        alone when the image was not split (rows = cols = 0)."""
        placeholders = self.image * per_tile
        whole = f"{self.fake}{self.whole}{placeholders}{self.fake}"
        if not rows and not cols:
            return whole
        grid = "".join(
            "".join(f"{self.fake}<row_{r}_col_{c}>{placeholders}" for c in range(1, cols + 1))
            + "\n"
            for r in range(1, rows + 1)
        )
        return f"{grid}\n{whole}"


class Idefics3Rule(PlainJoin):
    """Idefics3 / SmolVLM: the tiles' expansion (Idefics3Strings.expansion) in the model's
    tokens, whose placeholder tokens take the encoder rows, tile after tile."""

    processor_kwargs: Mapping[str, Any] = {"return_row_col_info": True}

    def __init__(
        self, vision: VisionConfig, encode: Callable[[str], list[int]], strings: Idefics3Strings
    ) -> None:
        """encode: text -> the model's token ids, no BOS added. Raises ValueError when the
        tokenizer does not have <image> as config.json's image_token_id and
        <fake_token_around_image> as one token."""
        self.vision = vision
        self.encode = encode
        self.strings = strings
        image, fake = encode(strings.image), encode(strings.fake)
        if image != [vision.image_token_id] or len(fake) != 1:
            raise ValueError(
                f"the tokenizer makes {strings.image} {image} and {strings.fake} {fake}, but an "
                f"Idefics3 model needs {strings.image} to be config.json's image_token_id "
                f"[{vision.image_token_id}] and {strings.fake} one token: use the tokenizer "
                "that came with the model"
            )
        self._made: dict[tuple[int, int, int], Replacement] = {}  # by (rows, cols, per_tile)

    @classmethod
    def build(cls, vision: VisionConfig, tokenizer: Callable[[], Tokenizer]) -> Idefics3Rule:
        tok = tokenizer()
        return cls(
            vision,
            lambda text: tok.encode(text, add_special_tokens=False),
            Idefics3Strings.of(tok.hf),
        )

    def __call__(self, outputs: Mapping[str, Any]) -> Replacement:
        vision = self.vision
        pixels = outputs["pixel_values"]
        height, width = pixels.shape[-2:]
        side = height // vision.patch_size
        if height != width or not side or side % vision.scale_factor:
            raise ValueError(
                f"the image processor makes {height}x{width} tiles, which this model's pixel "
                f"shuffle cannot take: preprocessor_config.json's max_image_size must be a "
                f"square of a multiple of patch_size={vision.patch_size} x "
                f"scale_factor={vision.scale_factor} pixels (the tower's image_size is "
                f"{vision.image_size})"
            )
        rows, cols = _one(outputs, "rows"), _one(outputs, "cols")
        tiles = int(real_tiles(pixels).sum())
        want = rows * cols + 1 if rows or cols else 1
        if tiles != want:
            raise ValueError(
                f"the image processor split the image into {rows}x{cols} tiles and the whole "
                f"image, {want} tiles, but {tiles} of its {pixels.shape[-4]} tiles are not all "
                "zeros (the model takes all-zero tiles for padding and drops them): use the "
                "model's own image processor"
            )
        key = (rows, cols, (side // vision.scale_factor) ** 2)
        made = self._made.get(key)
        if made is None:
            made = self._made[key] = self._replacement(*key, tiles)
        return made

    def _replacement(self, rows: int, cols: int, per_tile: int, tiles: int) -> Replacement:
        ids = tuple(self.encode(self.strings.expansion(rows, cols, per_tile)))
        at = tuple(i for i, t in enumerate(ids) if t == self.vision.image_token_id)
        if len(at) != tiles * per_tile:
            raise ValueError(
                f"the tokenizer makes {len(at)} {self.strings.image} tokens of an expansion "
                f"that has {tiles * per_tile}: use the tokenizer that came with the model"
            )
        return Replacement(ids, at)


def _one(outputs: Mapping[str, Any], key: str) -> int:
    """The one image's `rows` / `cols` (return_row_col_info's [[n]])."""
    value = outputs.get(key)
    try:
        (only,) = (n for batch in value for n in batch)  # type: ignore[union-attr]
        return int(only)
    except (TypeError, ValueError):
        raise ValueError(
            f"the image processor gave no {key} of its tiles for one image (got {value!r}): "
            "use the model's own image processor, an Idefics3 one"
        ) from None


class Qwen2_5_VLRule(PlainJoin):
    """Qwen2.5-VL: one <|image_pad|> becomes grid t * h * w / spatial_merge_size**2 of them,
    every one an encoder row, as HF's Qwen2_5_VLProcessor expands it (the prompt's own
    <|vision_start|> and <|vision_end|> stay around them)."""

    processor_kwargs: Mapping[str, Any] = {}

    def __init__(self, vision: VisionConfig) -> None:
        self.vision = vision

    @classmethod
    def build(cls, vision: VisionConfig, tokenizer: Callable[[], Tokenizer]) -> Qwen2_5_VLRule:
        return cls(vision)

    def __call__(self, outputs: Mapping[str, Any]) -> Replacement:
        vision = self.vision
        merge = vision.spatial_merge_size
        patch = vision.num_channels * vision.temporal_patch_size * vision.patch_size**2
        grid, pixels = outputs.get("image_grid_thw"), outputs["pixel_values"]
        t, h, w = (int(n) for n in grid.reshape(-1).tolist()) if grid is not None else (0, 0, 0)
        if (
            grid is None
            or grid.numel() != 3
            or tuple(pixels.shape) != (t * h * w, patch)
            or h % merge
            or w % merge
        ):
            raise ValueError(
                f"the image processor makes pixel_values of shape {tuple(pixels.shape)} for a "
                f"grid of {t}x{h}x{w} patches; this model takes patches of {patch} values "
                f"(patch_size={vision.patch_size}, temporal_patch_size="
                f"{vision.temporal_patch_size}) in grids whose sides are multiples of "
                f"spatial_merge_size={merge}: preprocessor_config.json must match config.json"
            )
        n = t * h * w // merge**2
        return Replacement((vision.image_token_id,) * n, tuple(range(n)))


class NewlineJoin:
    """Joins as a tokenizer whose runs of newlines are tokens of their own (Gemma's) joins texts:
    the newline-only tokens that end `ids` and begin `more` become the tokens of one run."""

    def __init__(self, encode: Callable[[str], list[int]], decode: Callable[[int], str]) -> None:
        """encode: text -> the model's token ids, no BOS added; decode: one token's text."""
        self.encode = encode
        self.decode = decode
        self._newlines: dict[int, int] = {}  # token -> the newlines it is (0: anything else)

    def newlines(self, token: int) -> int:
        count = self._newlines.get(token)
        if count is None:
            text = self.decode(token)
            count = self._newlines[token] = len(text) if text and not text.strip("\n") else 0
        return count

    def __call__(self, ids: list[int], more: Sequence[int]) -> None:
        left, right, run = len(ids), 0, 0
        while left and (n := self.newlines(ids[left - 1])):
            left, run = left - 1, run + n
        while right < len(more) and (n := self.newlines(more[right])):
            right, run = right + 1, run + n
        if left < len(ids) and right:  # newlines on both sides of the seam: one run
            del ids[left:]
            ids.extend(self.encode("\n" * run))
            ids.extend(more[right:])
        else:
            ids.extend(more)


class Gemma3Rule:
    """Gemma 3: the placeholder <start_of_image> becomes HF Gemma3Processor's full image
    sequence, "\\n\\n<start_of_image>", tokens_per_image <image_soft_token>, then
    "<end_of_image>\\n\\n", whose soft tokens take the encoder rows; its blank lines merge with
    the prompt's newlines around it (NewlineJoin). One image is one image_size square (no
    pan-and-scan crops)."""

    processor_kwargs: Mapping[str, Any] = {}

    def __init__(self, vision: VisionConfig, blank: list[int], join: NewlineJoin) -> None:
        """blank: the tokenizer's "\\n\\n"."""
        assert vision.soft_token_id is not None and vision.end_token_id is not None
        self.vision = vision
        n = vision.tokens_per_image
        core = (vision.image_token_id, *(vision.soft_token_id,) * n, vision.end_token_id)
        first = len(blank) + 1
        self.replacement = Replacement((*blank, *core, *blank), tuple(range(first, first + n)))
        self.join = join

    @classmethod
    def build(cls, vision: VisionConfig, tokenizer: Callable[[], Tokenizer]) -> Gemma3Rule:
        tok = tokenizer()

        def encode(text: str) -> list[int]:
            return tok.encode(text, add_special_tokens=False)

        join = NewlineJoin(encode, lambda t: tok.decode([t], skip_special_tokens=False))
        return cls(vision, encode("\n\n"), join)

    def __call__(self, outputs: Mapping[str, Any]) -> Replacement:
        vision = self.vision
        crops = outputs.get("num_crops")
        if crops is not None and int(torch.as_tensor(crops).sum()):
            raise ValueError(
                "the image processor cut this image into pan-and-scan crops, which batchpage "
                "does not place: set do_pan_and_scan to false in preprocessor_config.json"
            )
        pixels = outputs["pixel_values"]
        want = (1, vision.num_channels, vision.image_size, vision.image_size)
        if tuple(pixels.shape) != want:
            raise ValueError(
                f"the image processor makes pixel values of shape {tuple(pixels.shape)}, but "
                f"this model's tower takes {want}: preprocessor_config.json's size must be "
                f"config.json's vision_config image_size={vision.image_size}"
            )
        return self.replacement


# The one table: family -> what replaces its placeholder token.
REPLACEMENT_RULES: Mapping[str, RuleBuilder] = {
    "llava": LlavaRule.build,
    "idefics3": Idefics3Rule.build,
    "qwen2_5_vl": Qwen2_5_VLRule.build,
    "gemma3_vl": Gemma3Rule.build,
}
