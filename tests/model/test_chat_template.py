"""Chat-template control: an override template (file or text), template variables
(chat_template_kwargs), OpenAI text-part content and unknown roles, through the Tokenizer and
LLM.chat, against transformers' own apply_chat_template with the same template."""

from __future__ import annotations

from pathlib import Path

import pytest

from batchpage import LLM, SamplingParams
from batchpage.chat_messages import normalize_messages
from batchpage.model.tokenizer import Tokenizer, check_chat_template_kwargs, resolve_chat_template

# ChatML with a thinking switch, as Qwen3's template has: the kwargs must reach the template.
THINKING = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n{% endif %}"
    "{% endif %}"
)
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]


def reference_ids(hf_tokenizer, chat: list[dict], template: str | None, **kwargs) -> list[int]:
    text = hf_tokenizer.apply_chat_template(
        chat, chat_template=template, add_generation_prompt=True, tokenize=False, **kwargs
    )
    return hf_tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def llm(tiny_folder: Path) -> LLM:
    return LLM(str(tiny_folder), dtype="float32", kv_cache_memory=2**22, max_model_len=256)


def test_tokenizer_override_and_kwargs_match_transformers(tokenizer) -> None:
    ours = Tokenizer(tokenizer)
    for kwargs in ({}, {"enable_thinking": False}, {"enable_thinking": True}):
        got = ours.apply_chat_template(CHAT, chat_template=THINKING, chat_template_kwargs=kwargs)
        assert got == reference_ids(tokenizer, CHAT, THINKING, **kwargs)
    no_thinking = {"enable_thinking": False}
    off = ours.apply_chat_template(CHAT, chat_template=THINKING, chat_template_kwargs=no_thinking)
    assert "<think>" in tokenizer.decode(off) and "<think>" not in tokenizer.decode(
        ours.apply_chat_template(CHAT, chat_template=THINKING)
    )
    # No override: the model's own template, as before.
    assert ours.apply_chat_template(CHAT) == reference_ids(tokenizer, CHAT, None)


def test_content_parts_are_joined_text_and_unknown_roles_refused() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert normalize_messages([{"role": "user", "content": parts}]) == [
        {"role": "user", "content": "a\nb"}
    ]
    with pytest.raises(ValueError, match=r"messages\[1\] has role 'human'"):
        normalize_messages([{"role": "user", "content": "x"}, {"role": "human", "content": "y"}])
    with pytest.raises(ValueError, match=r"content\[0\] is an image part, and this model takes no"):
        normalize_messages([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])
    with pytest.raises(ValueError, match=r"is not a text or image part \(type 'audio'\)"):
        normalize_messages([{"role": "user", "content": [{"type": "audio"}]}])
    for bad in ([], "hi", [{"role": "user"}], [{"content": "x"}]):
        with pytest.raises(ValueError, match="messages"):
            normalize_messages(bad)


def test_resolve_chat_template_reads_files_and_refuses_bad_ones(tmp_path: Path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text(THINKING)
    assert resolve_chat_template(str(path)) == THINKING
    assert resolve_chat_template(THINKING) == THINKING and resolve_chat_template(None) is None
    with pytest.raises(ValueError, match="no such file"):
        resolve_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="not a valid Jinja template"):
        resolve_chat_template("{% for m in messages %}{{ m.content }}")
    with pytest.raises(ValueError, match="tokenize"):
        check_chat_template_kwargs({"tokenize": True})


def test_llm_chat_takes_template_and_kwargs(llm: LLM, tokenizer, tmp_path: Path) -> None:
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    path = tmp_path / "thinking.jinja"
    path.write_text(THINKING)
    text_parts = [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]
    parts = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text_parts}]
    outs = llm.chat(
        [CHAT, parts, [{"role": "narrator", "content": "x"}]],
        params,
        use_tqdm=False,
        chat_template=str(path),
        chat_template_kwargs={"enable_thinking": False},
    )
    want = reference_ids(tokenizer, CHAT, THINKING, enable_thinking=False)
    assert outs[0].prompt_token_ids == want and outs[0].error is None
    joined = [CHAT[0], {"role": "user", "content": "Hi\nthere"}]
    assert outs[1].prompt_token_ids == reference_ids(
        tokenizer, joined, THINKING, enable_thinking=False
    )
    assert outs[2].error is not None and "role 'narrator'" in outs[2].error
    assert not outs[2].outputs and len(outs[0].outputs[0].token_ids) == 2
    # Without arguments: the model's own template.
    plain = llm.chat(CHAT, params, use_tqdm=False)[0]
    assert plain.prompt_token_ids == reference_ids(tokenizer, CHAT, None)


def test_llm_chat_template_argument_is_the_default_for_chat(tiny_folder: Path, tokenizer) -> None:
    llm = LLM(
        str(tiny_folder),
        dtype="float32",
        kv_cache_memory=2**22,
        max_model_len=256,
        chat_template=THINKING,
    )
    out = llm.chat(CHAT, SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert out.prompt_token_ids == reference_ids(tokenizer, CHAT, THINKING)
    with pytest.raises(ValueError, match="no such file"):
        LLM(str(tiny_folder), chat_template="nowhere.jinja")
