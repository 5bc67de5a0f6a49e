"""A first generation with the bundled SmolLM2-135M-Instruct: `python jobs/quickstart.py`."""

from __future__ import annotations

from batchpage import LLM, SamplingParams


def main() -> None:
    llm = LLM(model="smollm2", max_model_len=2048)
    conversations = [
        [{"role": "user", "content": "What is the capital of France?"}],
        [{"role": "user", "content": "Write a haiku about the sea."}],
        [{"role": "user", "content": "Name three prime numbers."}],
        [{"role": "user", "content": "What does a paged KV cache store?"}],
    ]
    outputs = llm.chat(conversations, SamplingParams(temperature=0.0, max_tokens=48))
    for conv, out in zip(conversations, outputs, strict=True):
        print(f"> {conv[0]['content']}\n{out.outputs[0].text.strip()}\n")
    stats = llm.stats
    print(
        f"{stats['generated_tokens']} tokens in {stats['elapsed_s']:.2f} s "
        f"({stats['output_tokens_per_s']:.1f} tok/s), kv_utilization {stats['kv_utilization']:.2f}"
    )


if __name__ == "__main__":
    main()
