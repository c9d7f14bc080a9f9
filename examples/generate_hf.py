"""Generate with an HF transformers model through a kvforge cache.

    PYTHONPATH=build/python python3 examples/generate_hf.py [variant]   # default vllm_paged_nhd.tiny.fp32

Builds a tiny Llama (random weights, fixed seed: nothing is downloaded) whose shape matches the
variant's model, generates a batch of two prompts of different lengths through kvforge, and again
through transformers' own DynamicCache, and prints both. Exits 1 if the tokens differ.
"""

import sys

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

import kvforge
import kvforge.hf
from kvforge.torch_dtypes import TORCH_DTYPES


def main(variant):
    d = kvforge.describe(variant)
    config = LlamaConfig(vocab_size=128, hidden_size=4 * d.head_dim, intermediate_size=8 * d.head_dim,
                         num_hidden_layers=d.layers, num_attention_heads=4, num_key_value_heads=d.heads,
                         head_dim=d.head_dim, max_position_embeddings=d.max_seq_len)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval().to(TORCH_DTYPES[d.input])
    prompts = torch.randint(1, 128, (2, 8))
    mask = torch.ones_like(prompts)
    mask[1, :3] = 0  # the second prompt is shorter: left padding

    def generate(cache):
        with torch.no_grad():
            return model.generate(prompts, attention_mask=mask, max_new_tokens=16, do_sample=False, cache=cache,
                                  pad_token_id=0)

    cache = kvforge.hf.KvforgeCache(variant, config, batch_size=2)
    ours = generate(cache)
    theirs = generate(DynamicCache(config=config))
    memory = cache.kv.memory()
    print(f"{variant}: {d.addressing} {d.storage}, {d.bytes_per_token} B/token, "
          f"{memory['storage_bytes']} B of storage, {memory['overhead_bytes']} B of runtime overhead")
    for row in range(2):
        print(f"  kvforge      {ours[row, 8:].tolist()}")
        print(f"  DynamicCache {theirs[row, 8:].tolist()}")
    same = torch.equal(ours, theirs)
    print("same tokens" if same else "TOKENS DIFFER")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "vllm_paged_nhd.tiny.fp32"))
