"""What only a GPU can show, in one command for the first session that has one (under 20 minutes on one H100):

    python benchmarks/gpu_check.py --json            # on a CUDA machine
    python benchmarks/gpu_check.py --dry-run --json  # the same code at toy sizes on the CPU (tests/test_gpu_check.py)

One row per check, in a table, and one JSON object on the last line:
  cuda_tests       tests/test_cuda.py through pytest: passed, failed, skipped
  engine_eager     the largest |log-prob - grouped_logits'| of the eager engine (Bridge blocks, ragged prompts), the
                   reference computed by the teacher-forced grouped forward of the same weights
  engine_compiled  the same for the compiled decode step; its compile seconds; dynamo's graphs, graph breaks and
                   recompiles while it ran
  host_syncs       synchronising CUDA calls per decode step of the eager engine (torch.cuda.set_sync_debug_mode)
  decode           tok/s of the paper's 1.5B shape (bf16, 64 rows, 128 new tokens, compiled) against its bandwidth
                   roofline: a step reads every weight once and each row's KV cache, at the measured copy bandwidth
  memory           that run's peak GPU memory against `bridgelm plan`'s weights and KV cache of the same batch
  grpo_step        benchmarks/train.py in a child process: one GRPO step of bridgelm against TRL's GRPOTrainer
  fsdp_rollout     a rollout from a model sharded by FSDP2 in a process group of one: the same tokens as unsharded

--dry-run keeps every code path (the compiled step included) with a 2-layer model of hidden size 64 on the CPU, so
that the script cannot rot unseen; its figures mean nothing. The dry run's CPU has no CUDA: the sync count is None.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the tested reference: test_engine.teacher_forced_logprobs

import torch  # noqa: E402
from generate import shape_model, with_random_bridge  # noqa: E402

from bridgelm.engine import SamplingConfig, generate_ids  # noqa: E402
from bridgelm.hardware import copy_bandwidth  # noqa: E402

TOY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
       "num_key_value_heads": 2, "vocab_size": 256}


def settings(dry: bool) -> dict:
    """Sizes of the checks: the paper's 1.5B shape in bf16 on a GPU, a toy model in fp32 on the CPU."""
    if dry:
        return {"device": "cpu", "dtype": torch.float32, "shape": "30m", "overrides": TOY, "rows": 8, "tokens": 16,
                "copy_mib": 64}
    return {"device": "cuda", "dtype": torch.bfloat16, "shape": "ds-qwen-1.5b", "overrides": {}, "rows": 64,
            "tokens": 128, "copy_mib": 1024}


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


def host_syncs(model, s: dict) -> float | None:
    """Synchronising CUDA calls per decode step of the eager engine (None without CUDA)."""
    if s["device"] != "cuda":
        return None
    prompts = ragged_prompts(8, model.config.vocab_size)
    cfg = SamplingConfig(n=4, width=4, max_new_tokens=32, compile=False)
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            generate_ids(model, prompts, cfg, eos_token_ids=[], pad_token_id=0)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return round(sum("synchroniz" in str(w.message) for w in seen) / cfg.max_new_tokens, 2)


def decode_speed(model, s: dict) -> dict:
    """tok/s of rows x tokens (compiled where the engine compiles), against the bandwidth roofline; peak memory."""
    rows, tokens = s["rows"], s["tokens"]
    prompts = ragged_prompts(rows // 4, model.config.vocab_size)
    cfg = SamplingConfig(n=4, width=4, max_new_tokens=tokens, temperature=0.6, top_p=0.95)
    generate_ids(model, prompts[:1], cfg, eos_token_ids=[], pad_token_id=0)  # compile and warm up
    if s["device"] == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    results = generate_ids(model, prompts, cfg, eos_token_ids=[], pad_token_id=0)
    if s["device"] == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    made = sum(len(x.token_ids) for r in results for x in r)
    bytes_per_step = sum(p.numel() * p.element_size() for p in model.parameters())
    c = model.config
    kv = 2 * c.num_hidden_layers * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads)
    bytes_per_step += rows * (12 + tokens // 2) * kv * torch.finfo(s["dtype"]).bits // 8  # mean context
    roof = rows * copy_bandwidth(s["device"], mib=s["copy_mib"]) / bytes_per_step
    out = {"tok_per_s": round(made / seconds, 1), "bw_roofline_tok_per_s": round(roof, 1),
           "over_bw_roofline": round(made / seconds / roof, 3)}
    if s["device"] == "cuda":
        out["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    return out


def planned_gib(model, s: dict) -> float:
    """`bridgelm plan`'s rows for the decode run (its weights and KV cache: rows x (longest prompt + tokens)), GiB."""
    from dataclasses import replace

    from bridgelm import plan
    from bridgelm.train.rl_config import RLConfig, default_rollout

    rollout = replace(default_rollout(), n=4, width=4, max_new_tokens=s["tokens"])
    cfg = RLConfig(prompts_per_step=s["rows"] // 4, rollout=rollout, beta=0.0)
    dtype = "bfloat16" if s["dtype"] == torch.bfloat16 else "float32"
    setup = plan.Setup(plan.shape_of(model), cfg, world=1, dtype=dtype, prompt_tokens=11)  # ragged_prompts: <= 11
    return round((plan.weights(setup) + plan.kv_cache(setup)) / plan.GIB, 3)


def grpo_step(dry: bool) -> dict:
    """benchmarks/train.py in a child process: seconds of one GRPO step, ours and TRL's, and their ratio."""
    where = ["--quick", "--device", "cpu"] if dry else ["--device", "cuda"]
    cmd = [sys.executable, str(ROOT / "benchmarks" / "train.py"), "--json", *where]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["exit %d" % proc.returncode])[-1]}
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    keys = ("ours_over_trl", "ours_bridge_over_trl_bridge")
    return {"ours_seconds": result["ours"]["seconds_per_step"], "trl_seconds": result["trl"]["seconds_per_step"],
            **{key: result[key] for key in keys}}


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


def cuda_tests() -> dict:
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", str(ROOT / "tests" / "test_cuda.py")],
                          capture_output=True, text=True, timeout=1200, cwd=ROOT)
    last = (proc.stdout.strip().splitlines() or [""])[-1]
    return {"exit": proc.returncode, "summary": last}


def run(dry: bool) -> dict:
    s = settings(dry)
    if not dry and not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA GPU here; --dry-run runs the same code on the CPU at toy sizes")
    model = model_for(s)
    out = {"device": torch.cuda.get_device_name() if s["device"] == "cuda" else "cpu", "dry_run": dry}
    out["cuda_tests"] = cuda_tests()
    out["engine_eager"] = engine_error(model_for(s, layers=2), False, s)
    out["engine_compiled"] = engine_error(model_for(s, layers=2), True, s)
    out["host_syncs_per_step"] = host_syncs(model, s)
    out["decode"] = decode_speed(model, s)
    out["memory"] = {"peak_gib": out["decode"].get("peak_gib"), "planned_gib": planned_gib(model, s)}
    del model
    out["grpo_step"] = grpo_step(dry)
    out["fsdp_rollout"] = fsdp_rollout(s)
    return out


def table(out: dict) -> str:
    rows = [(key, json.dumps(value)) for key, value in out.items()]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="toy sizes on the CPU: every code path, no meaning")
    ap.add_argument("--json", action="store_true", help="one JSON object as the last line")
    args = ap.parse_args()
    torch.manual_seed(0)
    out = run(args.dry_run)
    print(table(out))
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
