"""vLLM's CPU engine with kvforge's connector: a multi-turn chat whose earlier turns have left vLLM's own
prefix cache comes back from an int8 kvforge store in host memory (half the bytes of vLLM's bf16 blocks).

    bash tools/vllm-env                       # once: vLLM's CPU engine in .vllm-env
    PYTHONPATH=build/python .vllm-env/bin/python examples/vllm_connector.py

A small Llama of our own dimensions with random weights stands in for a model (nothing is downloaded);
the token ids are printed, and the prompt tokens vLLM took from the store (its own metric).
"""
import os
import tempfile

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import torch  # noqa: E402
import transformers  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402


def main():
    with tempfile.TemporaryDirectory() as path:
        config = transformers.LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=64)
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
        llm = LLM(model=path, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=2048, block_size=32,
                  enforce_eager=True, kv_cache_memory_bytes=16 << 20, disable_log_stats=False,
                  kv_transfer_config=KVTransferConfig(
                      kv_connector="KvforgeConnector", kv_connector_module_path="kvforge.vllm", kv_role="kv_both",
                      kv_connector_extra_config={"storage": "int8", "host_bytes": 64 << 20}))
        chat = list(range(1, 200))
        for turn in range(3):
            out = llm.generate([TokensPrompt(prompt_token_ids=chat)],
                               SamplingParams(max_tokens=12, temperature=0, detokenize=False), use_tqdm=False)
            answer = list(out[0].outputs[0].token_ids)
            print(f"turn {turn}: prompt of {len(chat)} tokens -> {answer}")
            chat += answer + list(range(300 + 20 * turn, 320 + 20 * turn))
            llm.reset_prefix_cache(reset_connector=False)  # vLLM forgets; kvforge's store remembers
        hits = sum(m.value for m in llm.get_metrics() if m.name == "vllm:external_prefix_cache_hits")
        print(f"prompt tokens served from kvforge's store: {int(hits)}")
        assert hits > 0


if __name__ == "__main__":
    main()
