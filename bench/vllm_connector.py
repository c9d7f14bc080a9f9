"""kvforge's vLLM connector against vLLM's own answers, on one multi-turn trace at equal host memory:
vLLM without a connector, vLLM's own CPU offload (SimpleCPUOffloadConnector, then OffloadingConnector
where it runs on the CPU engine), and kvforge.vllm in bf16 and in int8 and fp8.

Each conversation's next turn is its last prompt, the answer and new tokens; turns go round the
conversations, and vLLM's own prefix cache is reset before each turn (reset_connector=False), so every
prefix beyond the first turn must come from the host tier, which holds only part of the trace.

Reports per configuration: time to first token (a turn's generate with one new token, over the turns
after the first, as a ratio to the no-connector run in the same process), prefill tokens saved (vLLM's
own vllm:external_prefix_cache_hits over the prompt tokens after the first turn) and prefixes held
per GB (the store's tokens per GiB over the mean prompt of the last turn).

Run by .vllm-env's python (tools/vllm-env), PYTHONPATH the build's python/ folder:
    PYTHONPATH=build/python .vllm-env/bin/python bench/vllm_connector.py [--json out.json]
"""
import argparse
import json
import os
import random
import statistics
import tempfile
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

BLOCK = 32


def model(path, layers, hidden, kv_heads, head_dim):
    import torch
    import transformers
    config = transformers.LlamaConfig(vocab_size=2048, hidden_size=hidden, intermediate_size=2 * hidden,
                                      num_hidden_layers=layers, num_attention_heads=hidden // head_dim,
                                      num_key_value_heads=kv_heads, head_dim=head_dim, max_position_embeddings=4096)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)


def run(path, connector, extra, args):
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt
    kwargs = {}
    if connector:
        kwargs["kv_transfer_config"] = KVTransferConfig(kv_connector=connector, kv_role="kv_both",
                                                        kv_connector_extra_config=extra,
                                                        **({"kv_connector_module_path": "kvforge.vllm"}
                                                           if connector == "KvforgeConnector" else {}))
    llm = LLM(model=path, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=4096, block_size=BLOCK,
              enforce_eager=True, kv_cache_memory_bytes=args.device_bytes, disable_log_stats=False, seed=0, **kwargs)
    rng = random.Random(1)
    prompts = [[rng.randrange(1, 2000) for _ in range(args.prompt)] for _ in range(args.conversations)]
    first_token, later_prompt_tokens, saved = [], 0, 0

    def hits():
        return sum(m.value for m in llm.get_metrics() if m.name == "vllm:external_prefix_cache_hits")

    one = SamplingParams(max_tokens=1, temperature=0, detokenize=False)
    answer = SamplingParams(max_tokens=args.answer, temperature=0, detokenize=False)
    for turn in range(args.turns):
        for i in range(args.conversations):  # one request at a time: a turn's TTFT is its prefill alone
            llm.reset_prefix_cache(reset_connector=False)
            before = hits()
            start = time.perf_counter()
            llm.generate([TokensPrompt(prompt_token_ids=prompts[i])], one, use_tqdm=False)
            if turn:
                first_token.append(time.perf_counter() - start)
                later_prompt_tokens += len(prompts[i])
                saved += hits() - before
            out = llm.generate([TokensPrompt(prompt_token_ids=prompts[i])], answer, use_tqdm=False)
            prompts[i] = prompts[i] + list(out[0].outputs[0].token_ids) + \
                [rng.randrange(1, 2000) for _ in range(args.user)]
    result = {"ttft_s": statistics.median(first_token), "later_prompt_tokens": later_prompt_tokens,
              "prefill_saved_tokens": saved}
    if connector == "KvforgeConnector":
        from vllm.distributed.kv_transfer import get_kv_transfer_group
        store = get_kv_transfer_group()._store  # the worker's, in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)
        result["bytes_per_token"] = store.bytes_per_token()
        result["variant"] = store.descriptor.name
    llm.llm_engine.engine_core.shutdown()
    del llm
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=12)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=320)
    parser.add_argument("--answer", type=int, default=16)
    parser.add_argument("--user", type=int, default=24)
    parser.add_argument("--host-bytes", type=int, default=12 << 20)
    parser.add_argument("--device-bytes", type=int, default=64 << 20)
    parser.add_argument("--json")
    parser.add_argument("--model", help=argparse.SUPPRESS)  # internal: one configuration, in a process of its own
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    layers, hidden, kv_heads, head_dim = 4, 512, 4, 64
    engine_bytes_per_token = 2 * layers * kv_heads * head_dim * 2  # vLLM's own bf16 K and V
    configs = [("vLLM, no connector", None, None),
               ("vLLM SimpleCPUOffloadConnector", "SimpleCPUOffloadConnector", {"cpu_bytes_to_use": args.host_bytes}),
               ("vLLM OffloadingConnector", "OffloadingConnector", {"cpu_bytes_to_use": args.host_bytes}),
               ("kvforge bf16", "KvforgeConnector", {"host_bytes": args.host_bytes}),
               ("kvforge int8", "KvforgeConnector", {"storage": "int8", "host_bytes": args.host_bytes}),
               ("kvforge fp8_e4m3", "KvforgeConnector", {"storage": "fp8_e4m3", "host_bytes": args.host_bytes})]
    if args.one is not None:
        label, connector, extra = configs[args.one]
        print("RESULT " + json.dumps(dict(run(args.model, connector, extra, args), config=label)), flush=True)
        return
    import subprocess
    import sys
    rows = []
    with tempfile.TemporaryDirectory() as path:
        model(path, layers, hidden, kv_heads, head_dim)
        for i, (label, _, _) in enumerate(configs):
            # A process each: a peer that fails half-way through its start leaves vLLM's process state behind.
            cmd = [sys.executable, __file__, "--model", path, "--one", str(i)] + \
                [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k not in ("json", "model", "one")]
            done = subprocess.run(cmd, capture_output=True, text=True)
            lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
            if lines:
                r = json.loads(lines[-1][7:])
                r.setdefault("bytes_per_token", engine_bytes_per_token)
            else:
                errors = [line for line in done.stderr.splitlines() if "Error" in line or "Exception:" in line]
                r = {"config": label, "error": (errors[-1] if errors else f"exit {done.returncode}").split("Writing model")[0][-240:]}
            rows.append(r)
            print(json.dumps(r), flush=True)
    base = next(r for r in rows if r["config"] == "vLLM, no connector")
    print(f"\n{'configuration':34} {'TTFT vs none':>12} {'prefill saved':>14} {'B/token':>8} {'tokens/GiB':>11}")
    for r in rows:
        if "error" in r:
            print(f"{r['config']:34} {'does not run on the CPU engine: ' + r['error']}")
            continue
        saved = r["prefill_saved_tokens"] / max(1, r["later_prompt_tokens"])
        per_gib = (1 << 30) // r["bytes_per_token"]
        print(f"{r['config']:34} {r['ttft_s'] / base['ttft_s']:>11.2f}x {saved:>13.0%} {r['bytes_per_token']:>8} "
              f"{per_gib:>11}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
