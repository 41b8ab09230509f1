"""The measurements of benchmarks/gpu_check.py, one row a process: `python benchmarks/gpu_rows.py ROW [--dry-run]`
prints the row's JSON object(s), one a line (gpu_check.py runs this under a timeout and records what it prints)."""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import socket
import sys
import time
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the tested reference: test_engine.teacher_forced_logprobs

import torch  # noqa: E402
from bench_models import shape_model, with_random_bridge  # noqa: E402

from bridgelm.engine import SamplingConfig, generate_ids  # noqa: E402
from bridgelm.hardware import copy_bandwidth  # noqa: E402

TOY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
       "num_key_value_heads": 2, "vocab_size": 256}


def settings(dry: bool) -> dict:
    """Sizes of the checks: the paper's 1.5B shape in bf16 on a GPU, a toy model in fp32 on the CPU."""
    if dry:
        return {"device": "cpu", "dtype": torch.float32, "shape": "30m", "overrides": TOY, "rows": 8, "tokens": 16,
                "copy_mib": 64, "refill_layers": 2, "refill_tokens": 24}
    return {"device": "cuda", "dtype": torch.bfloat16, "shape": "ds-qwen-1.5b", "overrides": {}, "rows": 64,
            "tokens": 128, "copy_mib": 1024, "refill_layers": 8, "refill_tokens": 1024}


def model_for(s: dict, layers: int | None = None):
    overrides = {**s["overrides"], **({"num_hidden_layers": layers} if layers else {})}
    return with_random_bridge(shape_model(s["shape"], s["dtype"], device=s["device"], **overrides))


def ragged_prompts(count: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 12, (count,), generator=g).tolist()
    return [torch.randint(5, vocab, (n,), generator=g).tolist() for n in lengths]


def engine_error(model, compile: bool, s: dict) -> dict:
    """Largest |engine log-prob - grouped_logits'| over a ragged batch of Bridge groups; compile time and dynamo's
    counters for the compiled step."""
    from test_engine import teacher_forced_logprobs

    prompts = ragged_prompts(4, model.config.vocab_size)
    cfg = SamplingConfig(n=4, width=4, max_new_tokens=s["tokens"] // 2, temperature=0.9, top_p=0.9, seed=3,
                         compile=compile)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    start = time.perf_counter()
    results = generate_ids(model, prompts, cfg, eos_token_ids=[1], pad_token_id=0)
    seconds = time.perf_counter() - start
    reference = copy.deepcopy(model).float()
    with torch.no_grad():
        want = teacher_forced_logprobs(reference, prompts, results, 4, 0.9)
    got = [torch.tensor(x.logprobs) for r in results for x in r]
    error = max(float((g - w.cpu()).abs().max()) for g, w in zip(got, want) if len(g))
    out = {"max_abs_logprob_error": round(error, 6), "seconds": round(seconds, 2)}
    if compile:
        counters = torch._dynamo.utils.counters
        out |= {"graphs": counters["stats"]["unique_graphs"], "graph_breaks": sum(counters["graph_break"].values()),
                "recompiles": sum(counters["recompiles"].values()) if "recompiles" in counters else 0}
    return out


def host_syncs(model, s: dict) -> dict:
    """Synchronising CUDA calls of the eager engine: per decode step (the slope between two lengths of the same
    generation) and per call (prefill and handing the samples back); None without CUDA."""
    if s["device"] != "cuda":
        return {"per_step": None, "per_call": None}
    prompts = ragged_prompts(8, model.config.vocab_size)
    counts = {}
    for tokens in (16, 48):
        cfg = SamplingConfig(n=4, width=4, max_new_tokens=tokens, compile=False)
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                generate_ids(model, prompts, cfg, eos_token_ids=[], pad_token_id=0)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        counts[tokens] = sum("synchroniz" in str(w.message) for w in seen)
    per_step = (counts[48] - counts[16]) / 32
    return {"per_step": round(per_step, 2), "per_call": round(counts[16] - 16 * per_step, 1)}


def decode_speed(model, s: dict) -> dict:
    """tok/s of rows x tokens (compiled where the engine compiles), against the bandwidth roofline; peak memory.

    The warm-up is the timed call itself, once (same prompts, settings and seed: the same waves, shapes and graphs),
    so the timed run holds no compile and no CUDA-graph capture; compile_s is what the warm-up took beyond it.
    Graphs made or recompiles counted during the timed run say whether that held (0 and 0: a clean figure)."""
    rows, tokens = s["rows"], s["tokens"]
    prompts = ragged_prompts(rows // 4, model.config.vocab_size)
    cfg = SamplingConfig(n=4, width=4, max_new_tokens=tokens, temperature=0.6, top_p=0.95, seed=1)
    counters = torch._dynamo.utils.counters
    say(f"decode: warm-up of {rows} rows x {tokens} tokens")
    warm_s = _timed(lambda: generate_ids(model, prompts, cfg, eos_token_ids=[], pad_token_id=0), s)[1]
    graphs, recompiles = counters["stats"]["unique_graphs"], sum(counters["recompiles"].values())
    say(f"decode: warm-up took {warm_s:.1f} s, {graphs} graphs, {recompiles} recompiles; the timed run")
    if s["device"] == "cuda":
        torch.cuda.reset_peak_memory_stats()
    results, seconds = _timed(lambda: generate_ids(model, prompts, cfg, eos_token_ids=[], pad_token_id=0), s)
    made = sum(len(x.token_ids) for r in results for x in r)
    bytes_per_step = sum(p.numel() * p.element_size() for p in model.parameters())
    c = model.config
    kv = 2 * c.num_hidden_layers * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads)
    bytes_per_step += rows * (12 + tokens // 2) * kv * torch.finfo(s["dtype"]).bits // 8  # mean context
    roof = rows * copy_bandwidth(s["device"], mib=s["copy_mib"]) / bytes_per_step
    out = {"tok_per_s": round(made / seconds, 1), "bw_roofline_tok_per_s": round(roof, 1),
           "over_bw_roofline": float(f"{made / seconds / roof:.3g}"), "decode_s": round(seconds, 3),
           "compile_s": round(max(warm_s - seconds, 0.0), 2), "warmup_s": round(warm_s, 2),
           "graphs_in_timed_run": counters["stats"]["unique_graphs"] - graphs,
           "recompiles_in_timed_run": sum(counters["recompiles"].values()) - recompiles}
    if s["device"] == "cuda":
        out["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    return out


def refill_speed(model, s: dict) -> dict:
    """tok/s of a stream of 4 waves whose samples end raggedly, with finished groups' rows refilled from waiting
    prompts against plain waves (compiled where the engine compiles), each warmed up once on its timed call.

    With random weights the next token is close to uniform, so a set of end ids holding ~3/tokens of the vocabulary
    ends a sample after about tokens/3 steps, some only at max_new_tokens: the ragged lengths RL rollouts meet. Waves
    decode until their longest sample ends; refill keeps the rows busy but reads its whole ring every step."""
    rows, tokens, vocab = s["rows"], s["refill_tokens"], model.config.vocab_size
    ends = list(range(5, vocab, max(1, (vocab - 5) * 3 // tokens)))
    prompts = ragged_prompts(rows, vocab, seed=2)  # x n=4 samples: 4 waves of `rows` rows
    out = {"rows": rows, "samples": 4 * rows, "max_new_tokens": tokens, "end_ids": len(ends)}
    tokens_of = {}
    for refill in (False, True):
        name = "refill" if refill else "waves"
        cfg = SamplingConfig(n=4, width=4, max_new_tokens=tokens, temperature=1.0, top_p=1.0, seed=2,
                             max_batch_sequences=rows, refill=refill)
        say(f"refill row: {name}, warm-up")
        warm_s = _timed(lambda: generate_ids(model, prompts, cfg, eos_token_ids=ends, pad_token_id=0), s)[1]
        say(f"refill row: {name}, warm-up took {warm_s:.1f} s; the timed run")
        results, seconds = _timed(lambda: generate_ids(model, prompts, cfg, eos_token_ids=ends, pad_token_id=0), s)
        made = sum(len(x.token_ids) for r in results for x in r)
        tokens_of[name] = [x.token_ids for r in results for x in r]
        out |= {f"{name}_tok_per_s": round(made / seconds, 1), f"{name}_s": round(seconds, 3),
                f"{name}_compile_s": round(max(warm_s - seconds, 0.0), 2)}
    out["mean_length"] = round(made / out["samples"], 1)
    out["refill_over_waves"] = round(out["refill_tok_per_s"] / out["waves_tok_per_s"], 3)
    out["same_samples"] = tokens_of["refill"] == tokens_of["waves"]  # exact in float32; bf16 rounding may part them
    return out


def say(line: str) -> None:
    """A progress line on stderr, kept in the row's log: a row cut off by its timeout says how far it came."""
    print(f"[{time.strftime('%H:%M:%S')}] {line}", file=sys.stderr, flush=True)


def _timed(fn, s: dict):
    """(fn(), seconds), with the GPU synchronised on both sides."""
    if s["device"] == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    if s["device"] == "cuda":
        torch.cuda.synchronize()
    return result, time.perf_counter() - start


def planned_gib(model, s: dict) -> float:
    """`bridgelm plan`'s rows for the decode run (its weights and KV cache: rows x (longest prompt + tokens)), GiB."""
    from dataclasses import replace

    from bridgelm import plan
    from bridgelm.shape import shape_of
    from bridgelm.train.rl_config import RLConfig, default_rollout

    rollout = replace(default_rollout(), n=4, width=4, max_new_tokens=s["tokens"])
    cfg = RLConfig(prompts_per_step=s["rows"] // 4, rollout=rollout, beta=0.0)
    dtype = "bfloat16" if s["dtype"] == torch.bfloat16 else "float32"
    setup = plan.Setup(shape_of(model), cfg, world=1, dtype=dtype, prompt_tokens=11)  # ragged_prompts: <= 11
    return round((plan.weights(setup) + plan.kv_cache(setup)) / plan.GIB, 3)


def fsdp_rollout(s: dict) -> dict:
    """A rollout from an FSDP2-sharded model in a process group of one (gathered once, as rl does): its tokens equal
    those of the same weights unsharded."""
    import torch.distributed as torch_dist

    from bridgelm.dist import Dist, shard_model, unsharded

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    backend = "nccl" if s["device"] == "cuda" else "gloo"
    torch_dist.init_process_group(backend, rank=0, world_size=1)
    try:
        model = model_for(s, layers=2)
        plain = copy.deepcopy(model)
        dist = Dist(0, 1, 0, torch.device(s["device"]))
        shard_model(model, dist)
        prompts = ragged_prompts(4, plain.config.vocab_size)
        cfg = SamplingConfig(n=4, width=4, max_new_tokens=s["tokens"] // 2, seed=5, compile=False)
        with unsharded(model, dist):
            sharded = generate_ids(model, prompts, cfg, eos_token_ids=[], pad_token_id=0)
        want = generate_ids(plain, prompts, cfg, eos_token_ids=[], pad_token_id=0)
        same = [x.token_ids for r in sharded for x in r] == [x.token_ids for r in want for x in r]
        return {"same_tokens": same}
    finally:
        torch_dist.destroy_process_group()


def env(s: dict) -> dict:
    """What ran: the versions a result depends on, and the device."""
    import transformers

    import bridgelm

    from importlib.metadata import PackageNotFoundError, version

    try:
        ours = version("bridgelm")
    except PackageNotFoundError:
        ours = None  # run from the source tree (PYTHONPATH=src)
    gpu = torch.cuda.get_device_name() if s["device"] == "cuda" else "cpu"
    return {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "transformers": transformers.__version__, "bridgelm": ours, "bridgelm_at": str(Path(bridgelm.__file__).parent),
            "device": gpu}


def row(name: str, dry: bool) -> dict[str, dict]:
    """The row(s) `name` measures: {row name: its fields}."""
    s = settings(dry)
    if not dry and not torch.cuda.is_available():
        raise SystemExit("gpu_rows: no CUDA GPU here; --dry-run runs the same code on the CPU at toy sizes")
    torch.manual_seed(0)
    if name == "env":
        return {"env": env(s)}
    if name in ("engine_eager", "engine_compiled"):
        return {name: engine_error(model_for(s, layers=2), name == "engine_compiled", s)}
    if name == "host_syncs":
        return {name: host_syncs(model_for(s), s)}
    if name == "decode":
        model = model_for(s)
        say(f"decode: {s['shape']} built, {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters")
        decode = decode_speed(model, s)
        return {"decode": decode, "memory": {"peak_gib": decode.get("peak_gib"), "planned_gib": planned_gib(model, s)}}
    if name == "fsdp_rollout":
        return {name: fsdp_rollout(s)}
    if name == "refill":
        return {name: refill_speed(model_for(s, layers=s["refill_layers"]), s)}
    raise SystemExit(f"gpu_rows: unknown row {name!r}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("row")
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args()
    for name, fields in row(args.row, args.dry_run).items():
        print(json.dumps({"row": name, **fields}), flush=True)


if __name__ == "__main__":
    main()
