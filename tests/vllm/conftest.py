"""kvforge.vllm against vLLM's own CPU engine (.vllm-env, tools/vllm-env): a small Llama of our own dims,
random weights, saved to a temporary folder; nothing is downloaded."""
import os

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: its store is readable
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
vllm = pytest.importorskip("vllm", reason="vLLM is not installed here: tools/vllm-env makes .vllm-env")

BLOCK = 32  # vLLM's CPU attention takes multiples of 32


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    import torch
    import transformers
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=192, intermediate_size=384, num_hidden_layers=3,
                                      num_attention_heads=6, num_key_value_heads=2, head_dim=32,
                                      max_position_embeddings=1024)
    torch.manual_seed(7)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    path = tmp_path_factory.mktemp("llama")
    model.save_pretrained(path)
    return str(path)


def make_llm(model_dir, extra=None, **kwargs):
    from vllm import LLM
    from vllm.config import KVTransferConfig
    if extra is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KvforgeConnector", kv_connector_module_path="kvforge.vllm", kv_role="kv_both",
            kv_connector_extra_config=extra)
    return LLM(model=model_dir, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=1024, block_size=BLOCK,
               enforce_eager=True, kv_cache_memory_bytes=32 << 20, disable_log_stats=False, seed=0, **kwargs)


def run_trace(llm, conversations, turns, new_tokens=8, params=None):
    """A multi-turn trace: each turn's prompt is the last one, its answer and 20 new tokens. vLLM's own
    prefix cache is reset between turns (the connector's store is kept), so what an earlier turn left
    must come back from the store. Returns the answers, turn by turn."""
    import random
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    rng = random.Random(3)
    prompts = [[rng.randrange(1, 500) for _ in range(n)] for n in conversations]
    answers = []
    sampling = SamplingParams(max_tokens=new_tokens, temperature=0, detokenize=False, **(params or {}))
    for _ in range(turns):
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sampling, use_tqdm=False)
        answers.append([list(o.outputs[0].token_ids) for o in outs])
        prompts = [p + a + [rng.randrange(1, 500) for _ in range(20)] for p, a in zip(prompts, answers[-1])]
        assert llm.reset_prefix_cache(reset_connector=False)
    return answers, prompts


def metric(llm, name):
    return sum(m.value for m in llm.get_metrics() if m.name == name)
