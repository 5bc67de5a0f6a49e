"""`batchpage export-hf`: the bundled GGUF model as a HF folder, on which PEFT makes a LoRA adapter
that batchpage then runs on the GGUF model itself, with HF + PEFT on the folder as the reference."""

from __future__ import annotations

import pytest
import torch

from batchpage import LLM, LoRARequest, SamplingParams
from batchpage.cli import main as cli_main
from tests.lora.peft_adapters import make_adapter


@pytest.mark.slow
def test_an_adapter_made_on_the_export_runs_on_the_gguf_model_as_peft_runs_it(tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tmp_path / "smollm2-hf"
    cli_main(["export-hf", "smollm2", str(folder)])
    assert capsys.readouterr().out.strip() == f"wrote {folder}"
    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    targets = ["q_proj", "v_proj", "down_proj"]
    peft = make_adapter(base, tmp_path / "adapter", rank=4, targets=targets)

    prompt = tokenizer("def fibonacci(n):")["input_ids"]
    with torch.no_grad():
        ids = peft.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0,
        )  # fmt: skip
    expected = ids[0, len(prompt) :].tolist()

    llm = LLM("smollm2", dtype="float32", quantized_weights=False, enable_lora=True,
              max_lora_rank=4, kv_cache_memory=2**24, max_model_len=64)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    lora = LoRARequest("made-on-the-export", 1, str(tmp_path / "adapter"))
    (out,) = llm.generate([prompt], params, lora_request=lora, use_tqdm=False)
    assert out.outputs[0].token_ids == expected
    (plain,) = llm.generate([prompt], params, use_tqdm=False)
    assert plain.outputs[0].token_ids != expected  # the adapter changed the tokens


def test_what_cannot_be_exported_is_exit_2_with_one_line(tmp_path, tiny_folder, capsys):
    for args in (["export-hf", str(tiny_folder), str(tmp_path / "x")],  # already a HF folder
                 ["export-hf", "smollm2", str(tmp_path)],  # the folder exists
                 ["export-hf", str(tmp_path / "missing.gguf"), str(tmp_path / "y")]):  # fmt: skip
        with pytest.raises(SystemExit) as e:
            cli_main(args)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1, err
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
