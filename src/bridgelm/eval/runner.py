"""Evaluation runs: n samples per problem for every benchmark and width (paper Sec. 4, App. E); bridgelm.eval.score
grades them.

Design notes:
- Samples first, scores second (human-eval): `run_eval` only samples into RUN_DIR; `bridgelm.eval.score.score_run`
  grades what is there and can be re-run alone (after a grader fix, with another G-Pass k, on a partial run...).
- RUN_DIR/run.json holds the settings (`eval_settings`). samples.jsonl holds one line per (benchmark, width,
  problem), appended as problems complete; a re-run skips what is written and redoes a line cut by a crash. A re-run
  with another model, other data or other sampling settings is refused before anything is written: one run, one
  setting (bridgelm.eval.folder, which reads a run back). The model folder and block file count by content too
  (runs.source_digests): blocks replaced at the same path make another run, refused by name.
- One writer per run: a second eval (or a score) on the same folder is refused at once (`_writer_locks`).
- Under torchrun, problem i of every benchmark goes to rank i % WORLD_SIZE (bridgelm.dist.Dist.owns), which appends
  to its own shard samples.rank{r}.jsonl with no process group; rank 0 writes run.json first (the others wait for
  the file), and the ranks meet at a gloo barrier once every shard is complete.
- A benchmark is one data file (named by its stem, e.g. `aime24`), or a Task object with its own examples
  (bridgelm.eval.datasets).
- Long documents (`Task.long_field()`, e.g. a CNN/DailyMail article) are cut to their longest token prefix whose
  prompt fits the model's context minus max_new_tokens; the cut is recorded on the problem's samples line
  ("truncated"), and run.json records the prompt budget.
- `accuracy` samples and grades in memory, without a run folder (RL's validation, the demo's pre-training checks).

    bridgelm eval --model DIR --task math --data math500.jsonl --data aime24.jsonl --n 32 --width 8 --out runs/x
    torchrun --nproc_per_node 8 -m bridgelm eval ...     (same arguments; one shard per rank)
    bridgelm score runs/x
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bridgelm.dist import SLOWEST_RANK_TIMEOUT, Dist, all_reduce_sum, barrier, unsharded
from bridgelm.engine import Sample, SamplingConfig, check_stop_strings, stream_text
from bridgelm.eval.datasets import Benchmark, load_benchmarks
from bridgelm.eval.folder import check_same_run, done_keys, read_eval_run, shard_file_name, shard_files, wait_for
from bridgelm.errors import UserError, check_int
from bridgelm.eval.prompts import fit_prompt, prompt_budget
from bridgelm.jsonl import append_record, exclusive, write_json
from bridgelm.progress import bar as progress_bar
from bridgelm.runs import RUN_FILE, SAMPLED_WITH, dtype_name, format_of, local_source, source_digests
from bridgelm.setting import setting
from bridgelm.tasks import Task
from bridgelm.tasks.base import check_rewards, is_correct

# How long ranks other than 0 wait for rank 0 to write run.json.
RUN_WAIT_SECONDS = 600.0



def eval_sampling(**changes: Any) -> SamplingConfig:
    """The evaluation's sampling: 32 samples per problem in Bridge groups of 8 at 0.6 / 0.95 (paper Sec. 4.1; its
    MATH-500: 4 at width 4), up to 4096 new tokens (this project's: the paper gives no evaluation length, 4096 is its
    RL's); `changes` set other values."""
    return SamplingConfig(**{"n": 32, "width": 8, "max_new_tokens": 4096, **changes})


@dataclass
class EvalConfig:
    """How to sample and score an evaluation run (the task and data files are arguments of `run_eval`)."""

    sampling: SamplingConfig = setting(
        default_factory=eval_sampling,
        help="how every (benchmark, width) is sampled; its width is the one tables report (when `widths` leave it "
             "out: the widest of them), its seed seeds the sampler of every (benchmark, width)",
    )
    widths: list[int] | None = setting(None, "widths to sample, each dividing n; None = [sampling.width]")
    chat: bool = setting(False, "wrap prompts with the tokenizer's chat template")
    stop: list[str] = setting(default_factory=list, help="stop strings that end a sample early")
    limit: int | None = setting(None, "only the first `limit` problems of each benchmark (smoke runs); None = all")
    split: str = setting("test", "split read from a data folder (FOLDER/SPLIT.jsonl) or from the hub's copy")
    gpass_k: int = setting(8, "k of G-Pass@k_tau (capped at n)")

    def all_widths(self) -> list[int]:
        """The widths to sample, in order."""
        return list(self.widths) if self.widths else [self.sampling.width]

    def main_width(self) -> int:
        """The width tables report: `sampling.width` when it is sampled, else the widest of `widths`."""
        widths = self.all_widths()
        return self.sampling.width if self.sampling.width in widths else max(widths)

    def validate(self, names: Mapping[str, str] | None = None) -> None:
        """UserError unless every width can be sampled. `names`: how messages name a setting of `sampling` and
        `limit` (its flag's words, e.g. {"n": "eval_n"}; else the field's own name)."""
        names = names or {}
        n, n_name = self.sampling.n, names.get("n", "n")
        check_int(n_name, n)
        widths = self.all_widths()
        given = f"widths={','.join(map(str, widths))}" if self.widths else None  # None samples `width` alone
        for w in widths:
            if given is None:
                check_int(names.get("width", "width"), w)
            elif isinstance(w, bool) or not isinstance(w, int) or w < 1:
                raise UserError(f"{given}: expected positive integers, not {w!r}")
            if n % w:
                which = f"{given}: width {w}" if given else f"{names.get('width', 'width')}={w}"
                raise UserError(f"{which} does not divide {n_name}={n}: every width must divide {n_name}")
        dup = sorted({w for w in widths if widths.count(w) > 1})
        if dup:
            raise UserError(f"{given} lists {dup[0]} more than once: expected each width once")
        if self.limit is not None:
            check_int(names.get("limit", "limit"), self.limit, note=" (left unset: every problem)")
        check_int("gpass_k", self.gpass_k)
        for w in widths:
            self.sampling_at(w).validate(names)
        check_stop_strings(self.stop)

    def sampling_at(self, width: int) -> SamplingConfig:
        """The engine's settings for one width (foreign groups only where a group has siblings)."""
        return replace(self.sampling, width=width, foreign_groups=self.sampling.foreign_groups and width > 1)


def eval_settings(
    cfg: EvalConfig, benches: Sequence[Benchmark], task_name: str, model_id: str, blocks: str | None, dtype: str
) -> dict[str, Any]:
    """The content of an eval run's run.json: every setting that decides what is sampled (runs.SAMPLED_WITH, with the
    widths sampled in place of one width), and what a reader needs besides."""
    s = cfg.sampling
    sampled = {k: getattr(cfg if k in ("chat", "stop") else s, k) for k in SAMPLED_WITH if k != "width"}
    return {
        **format_of("eval"),
        "model": local_source(model_id),
        "blocks": local_source(blocks),
        **source_digests(model_id, blocks),  # what is in them: a file replaced at the same path is another run
        "dtype": dtype,  # the model's weights: bf16 samples are other samples than fp32 ones
        "task": task_name,
        "data": [b.path for b in benches if b.path is not None],
        "benchmarks": [b.describe() for b in benches],
        **sampled,
        "stop": list(cfg.stop),
        "widths": cfg.all_widths(),
        "width": cfg.main_width(),  # the width tables report
        "limit": cfg.limit,
        "split": cfg.split,
        "gpass_k": cfg.gpass_k,
        "max_batch_sequences": s.max_batch_sequences,
        "max_batch_tokens": s.max_batch_tokens,
    }


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
    """Sample cfg.sampling.n responses per problem for every benchmark and width into `out_dir` (resumable).

    Returns {"run_dir", "shard" (this process's samples file), "sampled" (problems sampled now by this
    process), "skipped" (already written), "problems" (owned by this process), "truncated" (problems sampled
    now whose long document was cut to fit the context)}. Under torchrun (`dist` from RANK/WORLD_SIZE, no process
    group needed while sampling), returns once every rank has finished.
    """
    cfg.validate()
    benches = load_benchmarks(task_or_name, data_paths, cfg.limit, cfg.split)
    task_name = task_or_name.name if isinstance(task_or_name, Task) else task_or_name
    return sample_benchmarks(model, tokenizer, benches, task_name, cfg, out_dir, model_id, blocks, progress, dist)


def sample_benchmarks(
    model,
    tokenizer,
    benches: Sequence[Benchmark],
    task_name: str,
    cfg: EvalConfig,
    out_dir: str | os.PathLike,
    model_id: str,
    blocks: str | None = None,
    progress: bool = True,
    dist: Dist | None = None,
) -> dict[str, Any]:
    """`run_eval` on benchmarks already read (`load_benchmarks`) with a validated `cfg`: what `bridgelm eval` runs
    once it has checked the data before loading the model."""
    dist = dist or Dist.from_env()
    run_dir = Path(out_dir)
    settings = eval_settings(cfg, benches, task_name, model_id, blocks, dtype_name(model))
    budget = prompt_budget(model, cfg.sampling.max_new_tokens)
    if any(b.task.long_field() is not None for b in benches):
        settings["prompt_budget"] = budget  # long documents are cut to this many prompt tokens
    fresh = not run_dir.exists()  # the folder too: a run refused before any sample takes it away again
    with _writer_locks(run_dir, dist):
        created = _open_run(run_dir, settings, dist)
        out = run_dir / shard_file_name(dist)
        todo, owned = _todo(benches, cfg.all_widths(), done_keys(run_dir, own=out.name), dist)
        total = sum(len(v) for v in todo.values())
        show = bool(progress and total)  # a progress bar
        try:
            truncated = _sample_all_sets(model, tokenizer, benches, todo, cfg, budget, out, show, dist)
        except BaseException:
            # A check that fails before anything is sampled (a prompt longer than the context, foreign groups that do
            # not fill a width) leaves the folder as it found it, so that the corrected command starts afresh. One
            # process only: under torchrun another rank may be writing its first problem.
            if created and dist.world == 1 and not shard_files(run_dir):
                _take_back(run_dir, fresh)
            raise
    barrier(dist, SLOWEST_RANK_TIMEOUT)  # every shard is complete when this returns
    done = {"sampled": total, "skipped": owned - total, "problems": owned, "truncated": truncated}
    return {"run_dir": str(run_dir), "shard": str(out), **done}


def _todo(
    benches: Sequence[Benchmark], widths: list[int], done: set, dist: Dist
) -> tuple[dict[tuple[str, int], list[int]], int]:
    """({(benchmark, width): this process's problems still to sample}, how many (problem, width) it owns)."""
    todo = {
        (b.name, w): [i for i in range(len(b.problems)) if dist.owns(i) and (b.name, w, i) not in done]
        for b in benches
        for w in widths
    }
    owned = sum(1 for b in benches for i in range(len(b.problems)) if dist.owns(i)) * len(widths)
    return todo, owned


@contextlib.contextmanager
def _writer_locks(run_dir: Path, dist: Dist) -> Iterator[None]:
    """One writer per run folder: rank 0 holds the folder's lock (a second eval, or `bridgelm score`, is refused at
    once) and every rank the lock of its own shard. The ranks of one run never block each other, as each locks a
    file no other rank of it writes; a second run on the same folder is refused at rank 0 by the folder, and a second
    torchrun run of as many ranks at each rank r by samples.rank{r}.jsonl. (Its ranks r > 0 are not refused while a
    run of another size writes the folder: nothing ties a rank to its rank 0's lock; torchrun stops them when
    their rank 0 fails.)"""
    with contextlib.ExitStack() as locks:
        if dist.is_main:
            locks.enter_context(exclusive(run_dir, folder=True))
        locks.enter_context(exclusive(run_dir / shard_file_name(dist), folder=False))
        yield


def _take_back(run_dir: Path, fresh: bool) -> None:
    """Remove the run.json (and the locks, and the folder when this run made it) of a run that sampled nothing."""
    (run_dir / RUN_FILE).unlink(missing_ok=True)
    for lock in run_dir.glob(".*lock"):
        lock.unlink()
    if fresh and not any(run_dir.iterdir()):
        run_dir.rmdir()


def _open_run(run_dir: Path, settings: dict, dist: Dist) -> bool:
    """Check run_dir's run.json against `settings` (rank 0 writes it; the others wait for it and check it); returns
    whether this call wrote it first."""
    run_file = run_dir / RUN_FILE
    if not dist.is_main:  # the other ranks write nothing before rank 0 has checked the folder and written run.json
        wait_for(run_file, RUN_WAIT_SECONDS)
        check_same_run(run_file, json.loads(run_file.read_text()), settings)
        return False
    shards = shard_files(run_dir)  # listed before run.json is looked at: run.json is written before any shard
    created = not run_file.exists()
    if not created:
        check_same_run(run_file, read_eval_run(run_dir), settings)  # an eval run's, or a UserError
    elif shards:
        raise UserError(f"{run_dir} holds samples files but no {RUN_FILE}: refusing to mix into it; use another --out")
    write_json(run_file, settings)
    return created


def _sample_all_sets(model, tokenizer, benches, todo, cfg: EvalConfig, budget, out: Path, progress, dist) -> int:
    """Sample every (benchmark, width) of `todo` ({(name, width): problem indices}) into `out`, with a progress bar
    when `progress`; returns how many problems had their long document cut."""
    total = sum(len(v) for v in todo.values()) * cfg.sampling.n
    bar = progress_bar(total, f"sampling -> {out}", "sample", enabled=progress, position=dist.rank)
    truncated = 0
    try:
        for b in benches:
            for w in cfg.all_widths():
                if todo[(b.name, w)]:
                    truncated += _sample_set(model, tokenizer, b, w, todo[(b.name, w)], cfg, budget, out, bar.update)
    finally:
        bar.close()
    return truncated


def _sample_set(
    model, tokenizer, b: Benchmark, w: int, indices: list[int], cfg: EvalConfig, budget, out: Path, step: Callable
) -> int:
    """Sample problems `indices` of benchmark `b` at width `w`, appending a line per problem to `out` as it completes;
    returns how many had their long document cut."""
    fitted = []
    for i in indices:
        try:
            fitted.append(fit_prompt(b.task, b.problems[i], tokenizer, cfg.chat, budget))
        except ValueError as exc:
            raise UserError(f"benchmark {b.name!r} problem #{i}: {exc}") from exc
    texts = [text for text, _ in fitted]
    keys = [(b.name, i) for i in indices]  # a problem's samples do not depend on its shard
    stream = stream_text(model, tokenizer, texts, cfg.sampling_at(w), keys, cfg.chat, cfg.stop, progress=step)
    for k, samples in stream:
        i, cut = indices[k], fitted[k][1]
        line = {
            "benchmark": b.name,
            "width": w,
            "index": i,
            "prompt": texts[k],
            "answer": b.task.answer(b.problems[i]),
            "prompt_ids": samples[0].prompt_ids,
            "samples": [{"text": g.text, "token_ids": g.token_ids, "finished": g.finished} for g in samples],
        }
        append_record(out, {**line, "truncated": cut} if cut is not None else line)
    return sum(cut is not None for _, cut in fitted)


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
    """Mean accuracy of cfg.sampling.n samples per problem (at its width) on the first cfg.limit problems of `task`,
    sampled and graded in memory, without a run folder (RL's validation, the demo's pre-training checks).

    Problems are sharded over the ranks (all ranks call and get the same number); under FSDP every rank samples on
    the gathered weights.
    """
    dist = dist or Dist(device=next(model.parameters()).device)
    examples = task.examples[: cfg.limit] if cfg.limit is not None else task.examples
    mine = examples[dist.rank :: dist.world]
    with unsharded(model, dist):  # a collective under FSDP: ranks without problems take part too
        sampling = cfg.sampling_at(cfg.sampling.width)
        samples = sample_examples(model, tokenizer, task, mine, sampling, cfg.chat) if mine else []
    correct = sum(map(sum, grade_samples(task, mine, samples)))  # weights resharded meanwhile
    correct, count = all_reduce_sum([correct, len(mine) * cfg.sampling.n], dist)
    return correct / max(count, 1.0)
