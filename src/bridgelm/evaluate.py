"""Evaluation runs: n samples per problem for every benchmark and width (paper Sec. 4, App. E); bridgelm.score
grades them.

Design notes:
- Samples first, scores second (human-eval): `run_eval` only samples into RUN_DIR; `bridgelm.score.score_run`
  grades what is there and can be re-run alone (after a grader fix, with another G-Pass k, on a partial run...).
- RUN_DIR/run.json holds the settings. samples.jsonl holds one line per (benchmark, width, problem), appended as
  problems complete; a re-run skips what is written and redoes a line cut by a crash. A re-run with another
  model, other data or other sampling settings is refused before anything is written: one run, one setting
  (bridgelm.runs.check_settings).
- Under torchrun, problem i of every benchmark goes to rank i % WORLD_SIZE (bridgelm.dist.Dist.owns), which appends
  to its own shard samples.rank{r}.jsonl with no process group; rank 0 writes run.json first (the others wait for
  the file), and the ranks meet at a gloo barrier once every shard is complete. `read_samples` merges the shards
  and refuses problems written twice.
- A benchmark is one data file (named by its stem, e.g. `aime24`), or a Task object with its own examples.
- Long documents (`Task.long_field()`, e.g. a CNN/DailyMail article) are cut to their longest token prefix whose
  prompt fits the model's context minus max_new_tokens; the cut is recorded on the problem's samples line
  ("truncated"), and run.json records the prompt budget.
- `accuracy` samples and grades in memory, without a run folder (RL's validation, the demo's pre-training checks).

    bridgelm eval --model DIR --task math --data math500.jsonl --data aime24.jsonl --n 32 --width 8 --out runs/x
    torchrun --nproc_per_node 8 -m bridgelm eval ...     (same arguments; one shard per rank)
    bridgelm score runs/x
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from bridgelm.dist import Dist, all_reduce_sum, barrier, unsharded
from bridgelm.errors import UserError
from bridgelm.jsonl import append_record, read_records, write_json
from bridgelm.runs import RUN_FILE, check_settings, local_source, run_kind
from bridgelm.samples import check_stop_strings
from bridgelm.engine import Sample, SamplingConfig, encode_prompts, stream_text
from bridgelm.tasks import Task
from bridgelm.tasks.base import check_rewards, is_correct

FORMAT = "bridgelm-eval-1"
_SHARD_RE = re.compile(r"^samples(?:\.rank(\d+))?\.jsonl$")

# Settings of run.json that decide what is sampled; a re-run must match them all.
_COMPARED = (
    "model",
    "blocks",
    "task",
    "benchmarks",
    "n",
    "widths",
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "chat",
    "stop",
    "limit",
    "foreign_groups",
)

# How long ranks other than 0 wait for rank 0 to write run.json.
RUN_WAIT_SECONDS = 600.0

# How long ranks wait at the final barrier for the slowest shard.
BARRIER_TIMEOUT = timedelta(days=3)


@dataclass
class EvalConfig:
    """How to sample and score an evaluation run (the task and data files are arguments of `run_eval`)."""

    n: int = 32  # samples per problem
    width: int = 8  # Bridge group width that tables report (when `widths` leave it out: the widest of them)
    widths: list[int] | None = None  # widths to sample, each dividing n; None = [width]
    max_new_tokens: int = 4096  # generated tokens per sample, at most
    temperature: float = 0.6  # 0 = greedy
    top_p: float = 0.95  # nucleus mass in (0, 1]
    top_k: int = 0  # 0 = off
    seed: int = 0  # seeds the sampler of every (benchmark, width)
    chat: bool = False  # wrap prompts with the tokenizer's chat template
    stop: list[str] = field(default_factory=list)  # stop strings that end a sample early
    limit: int | None = None  # only the first `limit` problems of each benchmark (smoke runs); None = all
    max_batch_sequences: int = 256  # rows decoded together, at most (does not change what is measured)
    max_batch_tokens: int = 262_144  # rows x (prompt + max_new_tokens) of a batch, at most
    gpass_k: int = 8  # k of G-Pass@k_tau (capped at n)
    foreign_groups: bool = False  # control: groups of sample j of `width` different problems (see bridgelm.engine)

    def all_widths(self) -> list[int]:
        """The widths to sample, in order."""
        return list(self.widths) if self.widths else [self.width]

    def main_width(self) -> int:
        """The width tables report: `width` when it is sampled, else the widest of `widths`."""
        widths = self.all_widths()
        return self.width if self.width in widths else max(widths)

    def validate(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n={self.n!r} must be a positive integer")
        widths = self.all_widths()
        for w in widths:
            if not isinstance(w, int) or w < 1:
                raise ValueError(f"widths entry {w!r} must be a positive integer")
            if self.n % w:
                which = f"widths entry {w}" if self.widths else f"width={w}"  # widths=None samples `width` alone
                raise ValueError(f"{which} does not divide n={self.n}: every width must divide n")
        dup = sorted({w for w in widths if widths.count(w) > 1})
        if dup:
            raise ValueError(f"widths lists {dup[0]} more than once: {widths}")
        if self.limit is not None and (not isinstance(self.limit, int) or self.limit < 1):
            raise ValueError(f"limit={self.limit!r} must be a positive integer or None")
        if not isinstance(self.gpass_k, int) or self.gpass_k < 1:
            raise ValueError(f"gpass_k={self.gpass_k!r} must be a positive integer")
        for w in widths:
            self.sampling(w).validate()
        check_stop_strings(self.stop)

    def sampling(self, width: int) -> SamplingConfig:
        """The engine's settings for one width."""
        return SamplingConfig(
            n=self.n,
            width=width,
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            max_batch_sequences=self.max_batch_sequences,
            max_batch_tokens=self.max_batch_tokens,
            foreign_groups=self.foreign_groups and width > 1,
        )


# ---------------------------------------------------------------------------------------------- benchmarks


@dataclass
class Benchmark:
    """The problems of one data file (or of a Task object), with the task that prompts and grades them."""

    name: str  # file stem ("aime24"), or the task's name (the task's own examples, or a split file: see benchmark_name)
    path: str | None  # data file it was read from; None = the task's own examples
    task: Task  # prompt, gold answer, answer extraction and reward
    problems: list[dict]  # the examples evaluated (the first `limit` of the file)

    def digest(self) -> str:
        """Fingerprint of the prompts and gold answers: a changed data file cannot be mixed into a run."""
        return self.task.digest(self.problems)

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "path": self.path, "problems": len(self.problems), "digest": self.digest()}


# Stems that name a data set's split rather than the data set: such a file's benchmark is named after its folder.
SPLIT_STEMS = ("test", "train", "validation", "val", "dev")


def benchmark_name(task_name: str, path: str | os.PathLike) -> str:
    """The benchmark name of a data file: its stem (math500.jsonl -> math500), or for a file named after its split,
    its folder's name (gsm8k/test.jsonl -> gsm8k; gsm8k/train.jsonl -> gsm8k_train), the task's for a file given
    without a folder (test.jsonl -> the task's name)."""
    src = Path(path).expanduser()
    stem = src.stem if src.suffix else src.name
    if stem.lower() not in SPLIT_STEMS:
        return stem
    folder = src.parent.name if src.parent.name not in ("", ".", "..") else task_name
    return folder if stem.lower() == "test" else f"{folder}_{stem}"


def recorded_benchmarks(run_dir: str | os.PathLike) -> list[dict] | None:
    """The "benchmarks" of RUN_DIR's run.json (None: no run there yet), for `load_benchmarks(recorded=...)`."""
    return read_run(run_dir).get("benchmarks") if (Path(run_dir) / RUN_FILE).is_file() else None


def _adopt_recorded_names(benches: list[Benchmark], recorded: Sequence[dict] | None) -> None:
    """Benchmarks holding the very problems a run recorded (`recorded`: its run.json's "benchmarks", in order; the
    same count and fingerprint each) take the names it recorded: runs from before `benchmark_name` named a split file
    after its folder (gsm8k/test.jsonl was "test") still resume and score, wherever their files are now."""
    if not recorded or len(recorded) != len(benches):
        return
    if all((r.get("problems"), r.get("digest")) == (len(b.problems), b.digest()) for r, b in zip(recorded, benches)):
        for r, b in zip(recorded, benches):
            b.name = r.get("name", b.name)


def load_benchmarks(
    task_or_name: Task | str,
    data_paths: Sequence[str] | None = None,
    limit: int | None = None,
    recorded: Sequence[dict] | None = None,
):
    """Benchmarks of a run: one per data file of the registry task `task_or_name`, or the Task object itself.

    Without data files a task name gives one benchmark from the task's default source, named after the task.
    `recorded`: the "benchmarks" of the run's run.json, when it has one: the same problems keep the names it recorded.
    """
    from bridgelm import tasks

    paths = [str(p) for p in (data_paths or [])]
    if isinstance(task_or_name, Task):
        if paths:
            raise ValueError(
                f"a Task object brings its own examples, got data files {paths} as well: pass the task's registry "
                "name to read data files"
            )
        found = [(task_or_name.name, None, task_or_name)]
    elif isinstance(task_or_name, str):
        if not paths:
            found = [(task_or_name, None, tasks.load(task_or_name))]
        else:
            found = []
            for p in paths:
                found.append((benchmark_name(task_or_name, p), local_source(p), tasks.load(task_or_name, p)))
    else:
        raise TypeError(f"task_or_name must be a Task or a task name, got {type(task_or_name).__name__}")
    benches = []
    for name, path, task in found:
        problems = list(task.examples[:limit] if limit else task.examples)
        if not problems:
            raise ValueError(f"benchmark {name!r} ({path or 'task examples'}) holds no problems")
        benches.append(Benchmark(name, path, task, problems))
    _adopt_recorded_names(benches, recorded)
    seen = {}
    for b in benches:
        if b.name in seen:
            raise ValueError(f"two data files make the benchmark {b.name!r}: {seen[b.name]} and {b.path}; rename one")
        seen[b.name] = b.path
    return benches


# ---------------------------------------------------------------------------------------------- run directory


def shard_file_name(dist: Dist) -> str:
    """The samples file this process appends to: samples.jsonl, or samples.rank{r}.jsonl under torchrun."""
    return "samples.jsonl" if dist.world == 1 else f"samples.rank{dist.rank}.jsonl"


def shard_files(run_dir: str | os.PathLike) -> list[Path]:
    """samples.jsonl and samples.rank{r}.jsonl of a run, in rank order."""
    found = [p for p in Path(run_dir).glob("samples*.jsonl") if _SHARD_RE.match(p.name)]
    rank = lambda p: int(_SHARD_RE.match(p.name).group(1) or -1)  # noqa: E731
    return sorted(found, key=rank)


def read_run(run_dir: str | os.PathLike) -> dict[str, Any]:
    """The settings of a run (its run.json); UserError when `run_dir` is not an eval run."""
    path = Path(run_dir) / RUN_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: {run_dir} is not an eval run (made by bridgelm eval --out)")
    try:
        run = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UserError(f"{path} is not valid JSON ({err}): expected the run.json of bridgelm eval") from err
    if not isinstance(run, dict) or run.get("format") != FORMAT:
        kind = run_kind(run)
        what = f"a bridgelm {kind} training run" if kind not in (None, "eval") else "not an eval run"
        raise UserError(
            f"{run_dir} is {what} ({path} lacks format {FORMAT!r}): expected a folder made by bridgelm eval --out"
        )
    _check_run_fields(run, path)
    return run


def _check_run_fields(run: dict, path: Path) -> None:
    """UserError naming the first field of run.json that the readers of a run rely on and that is not what bridgelm
    eval writes (a file edited by hand)."""

    def positive(x) -> bool:
        return isinstance(x, int) and not isinstance(x, bool) and x > 0

    benches = run.get("benchmarks")
    checks = [
        ("n", positive(run.get("n")), "a positive integer"),
        (
            "widths",
            isinstance(run.get("widths"), list) and run["widths"] and all(map(positive, run["widths"])),
            "a non-empty list of positive integers",
        ),
        ("width", positive(run.get("width")), "a positive integer"),
        ("max_new_tokens", positive(run.get("max_new_tokens")), "a positive integer"),
        ("task", isinstance(run.get("task"), str), "a task name"),
        (
            "benchmarks",
            isinstance(benches, list)
            and benches
            and all(
                isinstance(b, dict) and isinstance(b.get("name"), str) and positive(b.get("problems")) for b in benches
            ),
            "a non-empty list of {name, path, problems, digest} objects",
        ),
    ]
    for name, ok, expected in checks:
        if not ok:
            raise UserError(
                f"{path}: field {name!r} is {run.get(name)!r}: expected {expected}, as bridgelm eval writes it"
            )


def _check_sample_line(rec: Any, path: Path, number: int) -> None:
    """UserError unless line `number` of a samples file holds a problem as bridgelm eval writes it: benchmark, width,
    index and a list of samples, each with its text, token ids and whether it finished."""

    def fail(what: str):
        raise UserError(f"{path}, line {number}: {what}, as bridgelm eval writes it (a file edited by hand?)")

    if not isinstance(rec, dict):
        fail("expected a JSON object")
    for key, kind in (("benchmark", str), ("width", int), ("index", int), ("samples", list)):
        if not isinstance(rec.get(key), kind) or isinstance(rec.get(key), bool):
            fail(f"field {key!r} is {rec.get(key)!r}: expected {'a list' if kind is list else kind.__name__}")
    for j, s in enumerate(rec["samples"]):
        ok = (
            isinstance(s, dict)
            and isinstance(s.get("text"), str)
            and isinstance(s.get("token_ids"), list)
            and isinstance(s.get("finished"), bool)
        )
        if not ok:
            fail(f"sample {j} is not an object with 'text' (text), 'token_ids' (a list) and 'finished' (true/false)")


def check_run_model(run_dir: str | os.PathLike, model_id: str, blocks: str | None) -> None:
    """UserError unless the run was sampled with this model and these blocks (its token ids fit only them)."""
    now = {"model": local_source(model_id), "blocks": local_source(blocks)}
    check_settings(
        run_dir,
        read_run(run_dir),
        now,
        keys=now,
        saved_as="run",
        why=": its samples must be re-run through the model and blocks that wrote them",
        fix="expected --model and --blocks as in its run.json",
    )


def run_settings(
    cfg: EvalConfig, benches: Sequence[Benchmark], task_name: str, model_id: str, blocks: str | None
) -> dict[str, Any]:
    """The content of run.json."""
    return {
        "format": FORMAT,
        "model": local_source(model_id),
        "blocks": local_source(blocks),
        "task": task_name,
        "data": [b.path for b in benches if b.path is not None],
        "benchmarks": [b.describe() for b in benches],
        "n": cfg.n,
        "widths": cfg.all_widths(),
        "width": cfg.main_width(),
        "max_new_tokens": cfg.max_new_tokens,
        "temperature": cfg.temperature,
        "top_p": cfg.top_p,
        "top_k": cfg.top_k,
        "seed": cfg.seed,
        "chat": cfg.chat,
        "stop": list(cfg.stop),
        "limit": cfg.limit,
        "gpass_k": cfg.gpass_k,
        "max_batch_sequences": cfg.max_batch_sequences,
        "max_batch_tokens": cfg.max_batch_tokens,
        # Only present when on, so that runs written before the option existed still resume.
        **({"foreign_groups": True} if cfg.foreign_groups else {}),
    }


def benchmark_difference(old: list[dict], new: list[dict]) -> str:
    old_names, new_names = [b["name"] for b in old], [b["name"] for b in new]
    if old_names != new_names:
        return f"benchmarks: run {old_names} vs now {new_names}"
    for a, b in zip(old, new):
        for key in ("path", "problems", "digest"):
            if a.get(key) != b.get(key):
                why = " (the data changed since it was sampled)" if key == "digest" else ""
                return f"benchmark {a['name']!r} {key}: run {a.get(key)!r} vs now {b.get(key)!r}{why}"
    return "benchmarks differ"


def check_same_run(path: Path, old: dict, new: dict) -> None:
    """UserError naming every setting of `new` that decides what is sampled and differs from the run's."""
    check_settings(
        path,
        old,
        new,
        keys=_COMPARED,
        saved_as="run",
        describe={"benchmarks": lambda a, b: benchmark_difference(a or [], b)},
        why=": samples of other settings would be scored together as one run, so mixing them is refused and nothing "
        "was written",
        fix="use another --out to compare runs",
    )


def _key(rec: dict) -> tuple[str, int, int]:
    return rec["benchmark"], int(rec["width"]), int(rec["index"])


def _done_keys(run_dir: Path, own: str) -> set[tuple[str, int, int]]:
    """Keys written in any shard; this process's own shard is repaired (a line cut by a crash is dropped)."""
    done = set()
    for path in shard_files(run_dir):
        done.update(_key(r) for r in read_records(path, repair=path.name == own))
    return done


def read_samples(run_dir: str | os.PathLike) -> dict[tuple[str, int, int], dict]:
    """Every sampled problem of a run, merged over its shards; a problem written twice is a ValueError, and a folder
    that is not an eval run a UserError (`read_run`)."""
    read_run(run_dir)
    merged: dict[tuple[str, int, int], dict] = {}
    where: dict[tuple[str, int, int], str] = {}
    twice = []
    for path in shard_files(run_dir):
        for number, rec in enumerate(read_records(path, repair=False), start=1):
            _check_sample_line(rec, path, number)
            key = _key(rec)
            if key in merged:
                twice.append(f"{key[0]} w={key[1]} #{key[2]} ({where[key]}, {path.name})")
                continue
            merged[key] = rec
            where[key] = path.name
    if twice:
        shown = ", ".join(twice[:5]) + (f" and {len(twice) - 5} more" if len(twice) > 5 else "")
        raise ValueError(
            f"{run_dir}: {len(twice)} problems were sampled more than once: {shown}. Each problem must be generated "
            "exactly once; were two eval runs writing into this directory at the same time?"
        )
    return merged


def _wait_for(path: Path, seconds: float) -> None:
    """Poll until `path` exists (written by rank 0), or fail after `seconds`."""
    import time

    deadline = time.monotonic() + seconds
    while not path.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{path} did not appear within {seconds:.0f}s: did rank 0 fail?")
        time.sleep(0.1)


# ---------------------------------------------------------------------------------------------- long documents


def prompt_budget(model, max_new_tokens: int) -> int | None:
    """Most prompt tokens a sample may have: the model's context minus max_new_tokens (None: no known context)."""
    context = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    return None if context is None else int(context) - int(max_new_tokens)


def _token_ends(tokenizer, text: str) -> list[int]:
    """Character offset where each token of `text` ends (slow tokenizers: lengths of decoded prefixes)."""
    try:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return [int(end) for _, end in enc["offset_mapping"]]
    except (NotImplementedError, KeyError, TypeError):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        return [len(tokenizer.decode(ids[: k + 1])) for k in range(len(ids))]


def fit_prompt(task: Task, example: dict, tokenizer, chat: bool, budget: int | None) -> tuple[str, dict | None]:
    """(prompt, cut) of `example`: when its prompt has more than `budget` tokens and the task names a long field,
    that field is cut to its longest token prefix whose prompt fits; `cut` describes it (None: nothing cut).

    A prompt that does not fit even with the field empty is a ValueError naming the sizes.
    """
    text = task.prompt(example)
    field_name = task.long_field()
    if field_name is None or budget is None:
        return text, None
    count = lambda t: len(encode_prompts(tokenizer, [t], chat, warn=False)[0])  # noqa: E731 (sampling warns)
    full = count(text)
    if full <= budget:
        return text, None
    document = str(example[field_name])
    ends = _token_ends(tokenizer, document)
    shortened = lambda k: task.prompt({**example, field_name: document[: ends[k - 1]] if k else ""})  # noqa: E731
    if count(shortened(0)) > budget:
        raise ValueError(
            f"the prompt has {count(shortened(0))} tokens even with its {field_name!r} empty: more than the "
            f"{budget} tokens left by the context after max_new_tokens; lower --max-new-tokens"
        )
    lo, hi = 0, len(ends)  # the largest k whose prompt fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count(shortened(mid)) <= budget:
            lo = mid
        else:
            hi = mid - 1
    cut = {
        "field": field_name,
        "prompt_tokens": full,  # before the cut
        "field_tokens": len(ends),
        "kept_tokens": lo,
        "kept_chars": ends[lo - 1] if lo else 0,
        "budget": budget,
    }
    return shortened(lo), cut


# ---------------------------------------------------------------------------------------------- sampling


def run_eval(
    model,
    tokenizer,
    task_or_name: Task | str,
    data_paths: Sequence[str] | None,
    cfg: EvalConfig,
    out_dir: str | os.PathLike,
    model_id: str,
    blocks: str | None = None,
    progress: bool = True,
    dist: Dist | None = None,
) -> dict[str, Any]:
    """Sample cfg.n responses per problem for every benchmark and width into `out_dir` (resumable).

    Returns {"run_dir", "shard" (this process's samples file), "sampled" (problems sampled now by this
    process), "skipped" (already written), "problems" (owned by this process), "truncated" (problems sampled
    now whose long document was cut to fit the context)}. Under torchrun (`dist` from RANK/WORLD_SIZE, no process
    group needed while sampling), returns once every rank has finished.
    """
    cfg.validate()
    dist = dist or Dist.from_env()
    benches = load_benchmarks(task_or_name, data_paths, cfg.limit, recorded=recorded_benchmarks(out_dir))
    task_name = task_or_name.name if isinstance(task_or_name, Task) else task_or_name
    run_dir = Path(out_dir)
    settings = run_settings(cfg, benches, task_name, model_id, blocks)
    budget = prompt_budget(model, cfg.max_new_tokens)
    if any(b.task.long_field() is not None for b in benches):
        settings["prompt_budget"] = budget  # long documents are cut to this many prompt tokens
    run_file = run_dir / RUN_FILE
    created = False  # run.json written by this call (main rank)
    fresh = not run_dir.exists()  # the folder too: a run refused before any sample takes it away again
    if dist.is_main:
        shards = shard_files(run_dir)  # listed before run.json is looked at: run.json is written before any shard
        created = not run_file.exists()
        if run_file.exists():
            check_same_run(run_file, read_run(run_dir), settings)  # an eval run's, or a UserError
        elif shards:
            raise ValueError(
                f"{run_dir} holds samples files but no {RUN_FILE}: refusing to mix into it; use another --out"
            )
        write_json(run_file, settings)
    else:  # the other ranks write nothing before rank 0 has checked the folder and written run.json
        _wait_for(run_file, RUN_WAIT_SECONDS)
        check_same_run(run_file, json.loads(run_file.read_text()), settings)
    out = run_dir / shard_file_name(dist)
    done = _done_keys(run_dir, own=out.name)
    todo = {
        (b.name, w): [i for i in range(len(b.problems)) if dist.owns(i) and (b.name, w, i) not in done]
        for b in benches
        for w in cfg.all_widths()
    }
    owned = sum(1 for b in benches for i in range(len(b.problems)) if dist.owns(i)) * len(cfg.all_widths())
    total = sum(len(v) for v in todo.values())
    bar = None
    if progress and total:
        from tqdm.auto import tqdm

        bar = tqdm(total=total * cfg.n, desc=f"sampling -> {out}", unit="sample", position=dist.rank)
    truncated = 0
    try:
        step = bar.update if bar is not None else (lambda k: None)
        for b in benches:
            for w in cfg.all_widths():
                indices = todo[(b.name, w)]
                if not indices:
                    continue
                fitted = []
                for i in indices:
                    try:
                        fitted.append(fit_prompt(b.task, b.problems[i], tokenizer, cfg.chat, budget))
                    except ValueError as exc:
                        raise ValueError(f"benchmark {b.name!r} problem #{i}: {exc}") from exc
                texts = [text for text, _ in fitted]
                truncated += sum(cut is not None for _, cut in fitted)
                keys = [(b.name, i) for i in indices]  # a problem's samples do not depend on its shard
                sampling = cfg.sampling(w)
                stream = stream_text(model, tokenizer, texts, sampling, keys, cfg.chat, cfg.stop, progress=step)
                for k, samples in stream:
                    i = indices[k]
                    append_record(
                        out,
                        {
                            "benchmark": b.name,
                            "width": w,
                            "index": i,
                            "prompt": texts[k],
                            "answer": b.task.answer(b.problems[i]),
                            "prompt_ids": samples[0].prompt_ids,
                            "samples": [
                                {"text": g.text, "token_ids": g.token_ids, "finished": g.finished} for g in samples
                            ],
                            **({"truncated": fitted[k][1]} if fitted[k][1] is not None else {}),
                        },
                    )
    except BaseException:
        # A check that fails before anything is sampled (a prompt longer than the context, foreign groups that do not
        # fill a width) leaves the folder as it found it, so that the corrected command starts afresh. One process
        # only: under torchrun another rank may be writing its first problem.
        if created and dist.world == 1 and not shard_files(run_dir):
            run_file.unlink(missing_ok=True)
            if fresh and not any(run_dir.iterdir()):
                run_dir.rmdir()
        raise
    finally:
        if bar is not None:
            bar.close()
    barrier(dist, BARRIER_TIMEOUT)  # every shard is complete when this returns
    return {
        "run_dir": str(run_dir),
        "shard": str(out),
        "sampled": total,
        "skipped": owned - total,
        "problems": owned,
        "truncated": truncated,
    }


# ---------------------------------------------------------------------------------------------- in memory


def sample_examples(
    model, tokenizer, task: Task, examples: Sequence[dict], sampling: SamplingConfig, chat: bool = False
) -> list[list[Sample]]:
    """`sampling.n` samples of each of `examples`, in memory: no run folder, nothing written."""
    return [s for _, s in stream_text(model, tokenizer, [task.prompt(ex) for ex in examples], sampling, chat=chat)]


def grade_samples(task: Task, examples: Sequence[dict], samples: Sequence[Sequence[Sample]]) -> list[list[bool]]:
    """Whether each sample of `sample_examples` is correct, graded by `task` (one list per example)."""
    pairs = [(task.graded_text(s.text, s.finished), ex) for ex, outs in zip(examples, samples) for s in outs]
    rewards = check_rewards(task.reward_many(pairs), f"task {task.name!r}")
    flags, at = [], 0
    for outs in samples:
        flags.append([is_correct(r) for r in rewards[at : at + len(outs)]])
        at += len(outs)
    return flags


def accuracy(model, tokenizer, task: Task, cfg: EvalConfig, dist: Dist | None = None) -> float:
    """Mean accuracy of cfg.n samples per problem (width cfg.width) on the first cfg.limit problems of `task`, sampled
    and graded in memory, without a run folder (RL's validation, the demo's pre-training checks).

    Problems are sharded over the ranks (all ranks call and get the same number); under FSDP every rank samples on
    the gathered weights.
    """
    dist = dist or Dist(device=next(model.parameters()).device)
    examples = task.examples[: cfg.limit] if cfg.limit is not None else task.examples
    mine = examples[dist.rank :: dist.world]
    with unsharded(model, dist):  # a collective under FSDP: ranks without problems take part too
        samples = sample_examples(model, tokenizer, task, mine, cfg.sampling(cfg.width), cfg.chat) if mine else []
    correct = sum(map(sum, grade_samples(task, mine, samples)))  # weights resharded meanwhile
    correct, count = all_reduce_sum([correct, len(mine) * cfg.n], dist)
    return correct / max(count, 1.0)
