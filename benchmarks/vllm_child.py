"""vLLM's side of `benchmarks/generate.py --vllm-python PATH`: run by that python, in vLLM's own environment.

It imports neither bridgelm nor anything of the parent's; it speaks JSON lines. The parent writes one setup line
(model folder, dtype, threads, cores, seed, rows, context, KV cache GiB), the child pins itself to those cores,
starts vLLM and answers {"ready": true, "startup_seconds", "vllm"}; then each run line ({"prompts": [[ids]], "n",
"max_tokens", "temperature", "top_p"}) is answered with {"tokens", "logprobs", "seconds"}: vLLM's generate on
those token ids, every sample running max_tokens (EOS ignored) and returning each token's log-prob (as bridgelm's
engine does), timed here (the pipe's time left out); {"quit": true} ends it. Replies go to the stdout the child
started with; everything else vLLM prints goes to stderr.

Settings that keep the work equal to the engine's: no prefix caching (the same prompts run every repeat, and the
engine recomputes them), vLLM's own sampling defaults rather than the model folder's generation_config, log-probs
after temperature and top-p (`processed_logprobs`; bridgelm's are after temperature only, the same cost).

No per-request seeds: vLLM 0.32's CPU build fails with them at 128 rows ("CPU Generator does not use offset");
one seed for the engine (LLM(seed=...)) instead.
"""

from __future__ import annotations

import json
import os
import sys
import time


def _replies():
    """A writer of reply lines to the original stdout; fd 1 then points at stderr, for vLLM's own prints."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def reply(obj: dict) -> None:
        out.write(json.dumps(obj) + "\n")
        out.flush()

    return reply


def _environment(setup: dict) -> None:
    """Threads and cores before vLLM loads: its OpenMP team bound to the parent's cores."""
    cores = [int(c) for c in setup["cores"]]
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cores)
    os.environ["OMP_NUM_THREADS"] = str(setup["threads"])
    contiguous = cores == list(range(cores[0], cores[0] + len(cores)))  # vLLM's documented form: "0-31"
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = f"{cores[0]}-{cores[-1]}" if contiguous else ",".join(map(str, cores))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(setup.get("kv_gib", 4)))


def _generate(llm, sampling_params, req: dict) -> dict:
    params = sampling_params(
        n=req["n"],
        temperature=req["temperature"],
        top_p=req["top_p"],
        max_tokens=req["max_tokens"],
        min_tokens=req["max_tokens"],
        ignore_eos=True,
        detokenize=False,
        logprobs=0,  # the sampled token's log-prob, as the engine returns
    )
    prompts = [{"prompt_token_ids": list(ids)} for ids in req["prompts"]]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    done = [c for o in outs for c in o.outputs]
    logprobs = sum(sum(t in lp for t, lp in zip(c.token_ids, c.logprobs or [])) for c in done)
    return {"tokens": sum(len(c.token_ids) for c in done), "logprobs": logprobs, "seconds": seconds}


def main() -> None:
    reply = _replies()
    setup = json.loads(sys.stdin.readline())
    _environment(setup)
    t0 = time.perf_counter()
    import vllm
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=setup["model"],
        dtype=setup["dtype"],
        seed=setup["seed"],
        skip_tokenizer_init=True,
        max_num_seqs=setup["max_num_seqs"],
        max_model_len=setup["max_model_len"],
        enable_prefix_caching=False,
        generation_config="vllm",
        logprobs_mode="processed_logprobs",
    )
    reply({"ready": True, "startup_seconds": time.perf_counter() - t0, "vllm": getattr(vllm, "__version__", "?")})
    for line in sys.stdin:
        req = json.loads(line)
        if req.get("quit"):
            break
        reply(_generate(llm, SamplingParams, req))


if __name__ == "__main__":  # vLLM's CPU build starts worker processes that import this module again
    main()
