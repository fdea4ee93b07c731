"""One vLLM instance through a workload, for the vLLM tests and `bench/vllm.py`.

    python -m hicache.tools.vllm_run --model DIR --make-model llama [--size small]
    python -m hicache.tools.vllm_run --model DIR --out R.json [--hicache CONFIG_JSON] ...
    python -m hicache.tools.vllm_run --model DIR --out R.json --workload W.json --way W [--config J]
    python -m hicache.tools.vllm_run --runs --reply-fd N   # runs read from stdin, one a line

Runs in its own process (vLLM keeps global state), with a random-weight checkpoint that
`--make-model` writes once (a Llama or a Qwen3 saved by transformers; ``tiny`` for the tests,
``small`` for the benchmark, whose prefill must cost something) and token-id prompts. The
checkpoint also holds a small byte-level tokenizer of the model's whole vocabulary, made here
without a download, so that a vLLM server on it takes text prompts (docs/vllm.md). Two
workloads:

- conversations (the tests'): each turn of each conversation is its prompt so far, the previous
  answer and a new user message; turns go to vLLM one round at a time, greedy. The result holds
  every answer, each request's time to first token, vLLM's preemptions and, where hicache runs
  with a metrics port, its counters scraped from the worker's endpoint at the end.
- a workload file (`--workload`, the benchmark's): rounds of prompts
  (``{"rounds": [[[token ids], ...], ...]}``); each round goes to vLLM as one `generate` call,
  greedy, rounds in order. The result holds every answer, each request's time to first token by
  round, the elapsed time, vLLM's own metrics and its OpenMP threads. `--way` names what sits
  beside vLLM's own prefix cache: nothing (``vllm``), hicache's connector (``hicache``,
  `--config` its configuration as JSON), LMCache in its multiprocess mode (``lmcache``,
  `--config` ``{"port": P}`` of an `lmcache server` already running) or vLLM's
  ``ExampleConnector`` (``example``, `--config` ``{"path": DIR}``).

With `--runs`, one process runs many: each line of stdin is one run's arguments (a JSON list,
as on the command line), run in turn in this process, so that torch and vLLM are imported once
for all of them (each run still builds its own `LLM` and shuts it down); for each, one JSON
line goes to the file descriptor `--reply-fd`: ``{"ok": true}`` once its result file is
written, or ``{"error": TRACEBACK}``, after which the process exits (vLLM's state after a
failed run is not to be trusted). vLLM's own output goes to stdout and stderr as usual.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import time
import urllib.request
from pathlib import Path

VOCAB = 512


SIZES = {
    # 2 layers for the tests; 4 wider ones for the benchmark, whose prefill must cost something
    "tiny": dict(
        hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4
    ),
    "small": dict(
        hidden_size=768, intermediate_size=2048, num_hidden_layers=4, num_attention_heads=12
    ),
}


# The text the tokenizer's merges are learnt from: fixed, so every checkpoint gets the same ones.
TOKENIZER_TEXT = (
    "An inference engine keeps the KV of running requests in its paged pool and drops it when "
    "a request ends, so every turn of a conversation or an agent prefills its whole prompt "
    "again, although all but the last message was computed before. A tiered cache keeps those "
    "prefix pages in larger, slower tiers: pinned host memory, a local disk, a store shared by "
    "every instance. The quick brown fox jumps over the lazy dog; pack my box with five dozen "
    "liquor jugs. 0123456789 = + - * / ( ) [ ] { } < > , . ; : ! ? ' \" # $ % & @ ^ _ ` | ~"
)


def make_tokenizer(path: Path) -> None:
    """A byte-level BPE tokenizer of exactly `VOCAB` tokens (``<unk>``, ``<s>``, ``</s>`` as 0,
    1, 2 as the models' configs have them; every byte; merges learnt from `TOKENIZER_TEXT`), so
    that any text encodes and every id the model can answer decodes. Saved in transformers'
    format beside the weights."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tokenizer.train_from_iterator([TOKENIZER_TEXT], trainer)
    if tokenizer.get_vocab_size() != VOCAB:
        raise RuntimeError(f"the tokenizer has {tokenizer.get_vocab_size()} tokens, not {VOCAB}")
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(path)


def make_model(path: Path, arch: str, size: str = "tiny") -> None:
    """A random model that vLLM's CPU backend runs (head_dim 64), saved in fp32."""
    import torch
    import transformers

    shape = dict(
        vocab_size=VOCAB, num_key_value_heads=2, head_dim=64, max_position_embeddings=8192,
        tie_word_embeddings=False, initializer_range=0.1, torch_dtype="float32", **SIZES[size],
    )  # fmt: skip
    if arch == "llama":
        config = transformers.LlamaConfig(**shape)
        model_cls = transformers.LlamaForCausalLM
    elif arch == "qwen3":
        config = transformers.Qwen3Config(**shape)
        model_cls = transformers.Qwen3ForCausalLM
    else:
        raise SystemExit(f"unknown --arch {arch!r}: llama or qwen3")
    torch.manual_seed(0)
    model = model_cls(config)  # weights 5x the usual spread: answers depend on the whole prompt
    model.save_pretrained(path, safe_serialization=True)


def make(path: Path, arch: str, size: str = "tiny") -> None:
    """The model and its tokenizer in `path`, unless they are there already."""
    if not Path(path, "config.json").exists():
        make_model(path, arch, size)
    if not Path(path, "tokenizer.json").exists():  # checkpoints made before it had one
        make_tokenizer(path)


def make_adapters(model: Path, root: Path, count: int, rank: int = 8) -> list[Path]:
    """`count` LoRA adapters of the model (q and v projections, random A and B, so that each
    changes the answers), in PEFT's format that vLLM loads."""
    import torch
    from safetensors.torch import save_file

    config = json.loads(Path(model, "config.json").read_text())
    hidden, head = config["hidden_size"], config["head_dim"]
    outs = {
        "q_proj": config["num_attention_heads"] * head,
        "v_proj": config["num_key_value_heads"] * head,
    }
    paths = []
    for k in range(count):
        torch.manual_seed(100 + k)
        weights = {}
        for layer in range(config["num_hidden_layers"]):
            for proj, out in outs.items():
                name = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
                weights[f"{name}.lora_A.weight"] = torch.randn(rank, hidden) * 0.1
                weights[f"{name}.lora_B.weight"] = torch.randn(out, rank) * 0.1
        path = root / f"adapter{k}"
        path.mkdir(parents=True, exist_ok=True)
        save_file(weights, path / "adapter_model.safetensors")
        (path / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0,
            "bias": "none", "target_modules": list(outs), "base_model_name_or_path": str(model),
        }))  # fmt: skip
        paths.append(path)
    return paths


def conversations(args: argparse.Namespace) -> list[list[int]]:
    """The first prompt of each conversation (a shared system head, then its own message)."""
    rng = random.Random(args.seed)
    head = [rng.randrange(VOCAB) for _ in range(args.shared)]
    return [
        head + [rng.randrange(VOCAB) for _ in range(args.first)] for _ in range(args.conversations)
    ]


def scrape(port: int) -> dict[str, float]:
    """hicache's counters and gauges from its metrics endpoint, as ``name{labels}: value``."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("hicache_") and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def settle(llm, port: int, timeout_s: float = 60.0) -> dict[str, float]:
    """hicache's metrics once its store tiers have nothing queued or running. A tier's results
    are applied on the engine thread, which runs only when vLLM steps: meanwhile, one-token
    requests too short to look up or store make it step."""
    from vllm import SamplingParams

    deadline = time.monotonic() + timeout_s
    while True:
        m = scrape(port)
        busy = sum(
            v for k, v in m.items()
            if k.startswith(("hicache_tier_queue_depth", "hicache_tier_jobs_in_flight"))
        )  # fmt: skip
        if not busy or time.monotonic() > deadline:
            return m
        time.sleep(0.2)
        llm.generate([{"prompt_token_ids": [1]}], SamplingParams(max_tokens=1), use_tqdm=False)


def transfer_config(way: str, config: dict, model_id: dict | None = None):
    """vLLM's `KVTransferConfig` for one way (see the module's docstring); None for vLLM
    alone. `model_id`: extra settings of hicache's connector."""
    from vllm.config import KVTransferConfig

    if way == "hicache":
        settings = dict(
            kv_connector="HiCacheConnector",
            kv_connector_module_path="hicache.integrations.vllm",
            kv_connector_extra_config={"hicache": config, **(model_id or {})},
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


def vllm_metrics(llm) -> dict[str, float]:
    """vLLM's own metrics, as ``name{labels}: value``."""
    metrics = {}
    for m in llm.get_metrics():
        value = getattr(m, "value", None)
        labels = ",".join(
            f"{k}={v}" for k, v in sorted(m.labels.items()) if k not in ("engine", "model_name")
        )
        if isinstance(value, int | float):
            metrics[f"{m.name}{{{labels}}}" if labels else m.name] = value
    return metrics


def run_workload(args: argparse.Namespace) -> dict:
    """The benchmark's run: the rounds of `--workload`, one `generate` call each."""
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
    result = {
        "answers": answers,
        "ttft_s": ttft,
        "elapsed_s": elapsed,
        "vllm_metrics": vllm_metrics(llm),
        "omp_threads": threads,
    }
    shut_down(llm)
    return result


def run(args: argparse.Namespace) -> dict:
    """The tests' run: multi-turn conversations."""
    if args.tp > 1:  # vLLM's CPU workers each bind to a NUMA node unless given CPUs
        cpus = os.cpu_count() or 1
        os.environ.setdefault(
            "VLLM_CPU_OMP_THREADS_BIND", "|".join(str(r % cpus) for r in range(args.tp))
        )
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    lora = {}
    if args.lora_adapters:
        lora = dict(enable_lora=True, max_lora_rank=8, max_loras=args.lora_adapters)

    transfer = None
    if args.hicache:
        transfer = transfer_config("hicache", json.loads(args.hicache), _model_id(args))
    elif args.disk_connector:
        transfer = transfer_config("example", {"path": args.disk_connector})
    llm = LLM(
        model=args.model,
        skip_tokenizer_init=True,
        dtype="float32",
        block_size=args.block,
        max_model_len=args.max_model_len,
        enable_prefix_caching=args.prefix_caching,
        kv_cache_memory_bytes=args.kv_bytes,
        kv_transfer_config=transfer,
        distributed_executor_backend=args.executor,
        disable_log_stats=False,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_batched_tokens,
        tensor_parallel_size=args.tp,
        enforce_eager=True,
        seed=0,
        **lora,
    )
    rng = random.Random(args.seed + 1)
    params = SamplingParams(temperature=0.0, max_tokens=args.output, ignore_eos=True)
    prompts = conversations(args)
    adapters = None
    if args.lora_adapters:  # every conversation once under each adapter: the same first prompts
        root = Path(args.out).parent / "adapters"
        paths = make_adapters(Path(args.model), root, args.lora_adapters)
        adapters = [
            LoRARequest(f"adapter{k}", k + 1, str(path))
            for k, path in enumerate(paths)
            for _ in prompts
        ]
        prompts = prompts * args.lora_adapters
    answers: list[list[list[int]]] = [[] for _ in prompts]
    ttft: list[float] = []
    started = time.perf_counter()
    for turn in range(args.turns):
        if turn:
            prompts = [
                p + answers[i][-1] + [rng.randrange(VOCAB) for _ in range(args.user)]
                for i, p in enumerate(prompts)
            ]
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
            lora_request=adapters,
        )  # fmt: skip
        if args.kill_pid and turn + 1 == args.kill_after_turn:
            os.kill(args.kill_pid, signal.SIGKILL)
        for i, out in enumerate(outs):
            answers[i].append(list(out.outputs[0].token_ids))
            m = out.metrics
            if m is not None and getattr(m, "first_token_latency", None) is not None:
                ttft.append(float(m.first_token_latency))
    elapsed = time.perf_counter() - started
    metrics = vllm_metrics(llm)
    result = {
        "answers": answers,
        "ttft_s": ttft,
        "elapsed_s": elapsed,
        "preemptions": metrics.get("vllm:num_preemptions"),
        "vllm_metrics": metrics,
    }
    if args.metrics_port:  # each TP rank serves its own metrics, on the port plus its rank
        ranks = [settle(llm, args.metrics_port + rank) for rank in range(args.tp)]
        result["hicache"], result["hicache_by_rank"] = ranks[0], ranks
    shut_down(llm)
    return result


def shut_down(llm) -> None:
    """Stop vLLM's engine now, its connector with it (hicache's store tiers finish their writes,
    which a later instance reads), not at the interpreter's exit: with the engine core in this
    process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) that runs as the interpreter is torn down, too
    late for the disk tier's writer threads."""
    llm.llm_engine.engine_core.shutdown()


def _model_id(args: argparse.Namespace) -> dict:
    return {"model_id": args.model_id} if args.model_id else {}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--make-model", choices=["llama", "qwen3"])
    p.add_argument("--size", choices=sorted(SIZES), default="tiny", help="with --make-model")
    p.add_argument("--out")
    p.add_argument("--workload", help="rounds of prompts (the benchmark's run), as JSON")
    p.add_argument("--way", default="vllm", choices=["vllm", "hicache", "lmcache", "example"])
    p.add_argument("--config", help="with --workload: the way's settings, as JSON")
    p.add_argument("--hicache", help="the hicache config, as JSON")
    p.add_argument("--model-id")
    p.add_argument("--disk-connector", help="run vLLM's ExampleConnector on this directory")
    p.add_argument("--metrics-port", type=int)
    p.add_argument("--prefix-caching", action="store_true")
    p.add_argument("--executor", default="uni", choices=["uni", "mp"])
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (needs --executor mp)")
    p.add_argument("--block", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--kv-bytes", type=int, default=64 << 20)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument(
        "--max-batched-tokens",
        type=int,
        help="tokens a step (fewer than a prompt: chunked prefill)",
    )
    p.add_argument("--conversations", type=int, default=4)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--shared", type=int, default=0, help="tokens of a head all conversations share")
    p.add_argument("--first", type=int, default=120)
    p.add_argument("--user", type=int, default=40)
    p.add_argument("--output", type=int, default=24)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--lora-adapters", type=int, default=0,
        help="run every conversation under each of this many LoRA adapters (made beside --out)",
    )  # fmt: skip
    p.add_argument("--kill-pid", type=int, help="SIGKILL this process (a Mooncake master)...")
    p.add_argument("--kill-after-turn", type=int, default=0, help="...after this turn")
    return p


def one(argv: list[str] | None = None) -> None:
    """One run (or a model made), as the command line `argv` asks."""
    args = parser().parse_args(argv)
    if args.make_model:
        make(Path(args.model), args.make_model, args.size)
        if not args.out:
            return
    result = run_workload(args) if args.workload else run(args)
    Path(args.out).write_text(json.dumps(result))


def runs(reply_fd: int) -> None:
    """`--runs`: the runs of stdin's lines in turn, each answered on `reply_fd` (see the
    module's docstring)."""
    import sys
    import traceback

    with os.fdopen(reply_fd, "w", buffering=1) as reply:
        for line in sys.stdin:
            try:
                one([str(a) for a in json.loads(line)])
            except BaseException:
                reply.write(json.dumps({"error": traceback.format_exc()}) + "\n")
                return
            reply.write(json.dumps({"ok": True}) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--runs", action="store_true")
    p.add_argument("--reply-fd", type=int)
    known, rest = p.parse_known_args()
    if known.runs:
        if known.reply_fd is None or rest:
            p.error("--runs takes --reply-fd N and nothing else (each run's arguments are a line)")
        runs(known.reply_fd)
    else:
        one(rest)


if __name__ == "__main__":
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    main()
