"""A stand-in for vLLM in tests of `benchmarks/generate.py --vllm-python` (tests/test_vllm_compare.py): the child
script (benchmarks/vllm_child.py) imports it as `vllm`. It makes the tokens asked for (ids from the prompt's
length, no model) and logs what it was given to $FAKE_VLLM_LOG, one JSON line per call."""

import json
import os

__version__ = "0.0+fake"


def _log(kind: str, **fields) -> None:
    with open(os.environ["FAKE_VLLM_LOG"], "a") as f:
        f.write(json.dumps({"kind": kind, **fields}) + "\n")


class SamplingParams:
    def __init__(self, **kwargs):
        self.kwargs = kwargs


class _Completion:
    def __init__(self, token_ids, logprobs: bool):
        self.token_ids = token_ids
        self.logprobs = [{t: -1.0} for t in token_ids] if logprobs else None  # vLLM's: one {id: Logprob} a token


class _Output:
    def __init__(self, outputs):
        self.outputs = outputs


class LLM:
    def __init__(self, **kwargs):
        names = ("OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE", "LD_PRELOAD")
        env = {k: os.environ.get(k) for k in names}
        print("fake vLLM: a line on stdout that must not reach the parent's pipe")
        _log("init", kwargs=kwargs, env=env, cores=sorted(os.sched_getaffinity(0)))
        self.short = os.environ.get("FAKE_VLLM_SHORT") == "1"  # makes one token too few: an unequal comparison

    def generate(self, prompts, params, use_tqdm=True):
        _log("generate", prompts=[p["prompt_token_ids"] for p in prompts], params=params.kwargs)
        k = params.kwargs
        made = k["max_tokens"] - (1 if self.short else 0)
        lp = k.get("logprobs") is not None and os.environ.get("FAKE_VLLM_NO_LOGPROBS") != "1"
        done = [[_Completion([len(p["prompt_token_ids"])] * made, lp) for _ in range(k["n"])] for p in prompts]
        return [_Output(c) for c in done]
