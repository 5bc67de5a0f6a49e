"""Quantized checkpoints split over ranks (gloo, CPU): each format's rank shares are cut from
its weights decoded to IntWeight's row-major layout, as a dense weight's are, and 2 and 4 ranks
give one rank's greedy tokens (float32: logprobs within the dense tests' 1e-4). W8A8 quantizes
each rank's share of a row-parallel input with a scale of its own (as vLLM does), so its
logprobs move by more; shapes that do not split into whole groups, and GPTQ's act order, are
refused in one line before any worker starts."""

from __future__ import annotations

import pytest

from batchpage import LLM, SamplingParams
from batchpage.job import run_job
from tests.job.test_loop import job, table, write_jsonl
from tests.quant.test_formats import PROMPTS, write_quantized

# Row-parallel inputs of 128 (o_proj) and 256 (down_proj): 4 and 8 groups of 32 inputs.
WIDE = {"hidden_size": 128, "intermediate_size": 256}
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=1)
CASES = [
    ("awq4_g32", 2), ("awq4_g32", 4), ("gptq4_sym_g32", 2), ("gptq4_asym_v1", 4),
    ("gptq8_channel", 2), ("ct_int4_sym_g32", 2), ("ct_int4_asym_g32", 4),
    ("ct_int8_channel", 2), ("ct_fp8_channel", 2), ("ct_fp8_block32", 4),
    ("fp8_tensor_static", 2), ("ct_w8a8", 2),
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


def test_shapes_that_do_not_split_into_whole_groups_and_act_order_are_refused(
    tmp_path, tokenizer
) -> None:
    """The tiny model's down_proj reads 96 inputs: 3 groups of 32, which 2 ranks cannot share."""
    folder, _ = write_quantized(tmp_path, "awq4_g32")
    tokenizer.save_pretrained(folder)
    with pytest.raises(ValueError, match=r"down_proj's 96 inputs in groups of 32 \(3 groups\)"):
        LLM(str(folder), dtype="float32", tensor_parallel_size=2)
    folder, _ = write_quantized(tmp_path, "gptq4_asym_desc_act_v2", **WIDE)
    tokenizer.save_pretrained(folder)
    with pytest.raises(ValueError, match="act order \\(desc_act\\)") as e:
        LLM(str(folder), dtype="float32", tensor_parallel_size=2)
    assert "\n" not in str(e.value)


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
