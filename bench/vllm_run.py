"""One vLLM instance through one workload file, for `bench/vllm.py`.

    python bench/vllm_run.py --model DIR --workload W.json --out R.json [--way W --config JSON]

Runs in its own process (vLLM keeps global state), with token-id prompts (no tokenizer). The
workload is rounds of prompts (`{"rounds": [[[token ids], ...], ...]}`); each round goes to
vLLM as one `generate` call, greedy, rounds in order. The result holds every answer, each
request's time to first token by round, the elapsed time and vLLM's own metrics.

`--way` names what sits beside vLLM's own prefix cache: nothing (``vllm``), hicache's connector
(``hicache``, `--config` its configuration as JSON), LMCache in its multiprocess mode
(``lmcache``, `--config` ``{"port": P}`` of an `lmcache server` already running) or vLLM's
``ExampleConnector`` (``example``, `--config` ``{"path": DIR}``).

`--make-model DIR` writes the benchmark's random Llama checkpoint once and exits.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

# bench/vllm.py would shadow the vllm package: this script's folder leaves the import path
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

VOCAB = 512
"""The benchmark model's vocabulary: prompt token ids must be below it."""


def make_model(path: Path) -> None:
    """A random 4-layer Llama that vLLM's CPU backend runs (head_dim 64, 2 KV heads), in fp32:
    4 KiB of KV cache a token. Its weights are spread wide so an answer depends on the prompt."""
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=768, intermediate_size=2048, num_hidden_layers=4,
        num_attention_heads=12, num_key_value_heads=2, head_dim=64,
        max_position_embeddings=8192, tie_word_embeddings=False, initializer_range=0.1,
        torch_dtype="float32",
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)


def transfer_config(way: str, config: dict):
    """vLLM's `KVTransferConfig` for one way; None for vLLM alone."""
    from vllm.config import KVTransferConfig

    if way == "hicache":
        settings = dict(
            kv_connector="HiCacheConnector",
            kv_connector_module_path="hicache.integrations.vllm",
            kv_connector_extra_config={"hicache": config},
        )
    elif way == "lmcache":
        settings = dict(
            kv_connector="LMCacheMPConnector",
            kv_connector_extra_config={
                "lmcache.mp.host": "tcp://127.0.0.1",
                "lmcache.mp.port": config["port"],
            },
        )
    elif way == "example":
        settings = dict(
            kv_connector="ExampleConnector",
            kv_connector_extra_config={"shared_storage_path": config["path"]},
        )
    else:
        return None
    return KVTransferConfig(kv_role="kv_both", **settings)


def run(args: argparse.Namespace) -> dict:
    from vllm import LLM, SamplingParams

    rounds = json.loads(Path(args.workload).read_text())["rounds"]
    llm = LLM(
        model=args.model,
        skip_tokenizer_init=True,
        dtype="float32",
        block_size=args.block,
        max_model_len=args.max_model_len,
        enable_prefix_caching=True,
        kv_cache_memory_bytes=args.kv_bytes,
        kv_transfer_config=transfer_config(args.way, json.loads(args.config or "{}")),
        disable_log_stats=False,
        max_num_seqs=args.max_num_seqs,
        enforce_eager=True,
        seed=0,
    )
    import torch

    threads = torch.get_num_threads()  # the engine runs in this process: its OMP threads
    params = SamplingParams(temperature=0.0, max_tokens=args.output, ignore_eos=True)
    answers: list[list[list[int]]] = []
    ttft: list[list[float]] = []
    started = time.perf_counter()
    for prompts in rounds:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        answers.append([list(o.outputs[0].token_ids) for o in outs])
        ttft.append([float(o.metrics.first_token_latency) for o in outs])
    elapsed = time.perf_counter() - started
    metrics = {}
    for m in llm.get_metrics():
        value = getattr(m, "value", None)
        labels = ",".join(
            f"{k}={v}" for k, v in sorted(m.labels.items()) if k not in ("engine", "model_name")
        )
        if isinstance(value, int | float):
            metrics[f"{m.name}{{{labels}}}" if labels else m.name] = value
    return {
        "answers": answers,
        "ttft_s": ttft,
        "elapsed_s": elapsed,
        "vllm_metrics": metrics,
        "omp_threads": threads,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--make-model", action="store_true", help="write the checkpoint and exit")
    p.add_argument("--workload")
    p.add_argument("--out")
    p.add_argument("--way", default="vllm", choices=["vllm", "hicache", "lmcache", "example"])
    p.add_argument("--config", help="the connector's settings, as JSON")
    p.add_argument("--block", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--kv-bytes", type=int, default=32 << 20)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--output", type=int, default=16, help="tokens of each answer")
    args = p.parse_args()
    if args.make_model:
        if not Path(args.model, "config.json").exists():
            make_model(Path(args.model))
        return
    Path(args.out).write_text(json.dumps(run(args)))


if __name__ == "__main__":
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    main()
