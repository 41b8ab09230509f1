"""Warm-up data for the SFT stage (paper Sec. 3.2 and 4.1): the base model answers each training problem n times,
independently (width 1); the answers are graded, the correct ones that ended (EOS, a stop string) kept, and
problems with one or fewer such answers dropped (SFT needs at least two answers of a problem to form a group). A
correct answer cut by max_new_tokens is not kept: trained on, it would teach the blocks a trace without its end
(GSM8K's grader, say, reads the last number of a cut text).

One JSON line per processed problem, appended as problems complete, so a re-run continues after the last one
(a dropped problem has a line too, with "kept": false). Lines carry the sampling settings; a re-run with other
settings is refused. A problem's answers are drawn from its own random streams (keyed by its index), so a resumed
run, or one over another number of processes, draws each problem as an uninterrupted one does (up to the rounding
of other batch shapes).

Under torchrun every rank samples its share of the problems (round-robin) into its own part beside the output
(warmup.rank{R}.jsonl); when the slowest rank is done, rank 0 writes the output with the parts' lines, in the
problems' order (one atomic write), and removes them. A re-run, with any number of processes, reads the output and
any parts left by an interrupted run as done.

    bridgelm warmup-data --model M --task gsm8k --data train.jsonl --n 8 --out warmup.jsonl
    torchrun --nproc_per_node 8 -m bridgelm warmup-data --model M --device cuda ... --out warmup.jsonl
"""

from __future__ import annotations

import json
import os
import sys
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path

from bridgelm.dist import SLOWEST_RANK_TIMEOUT, Dist, barrier
from bridgelm.errors import UserError, check_int
from bridgelm.jsonl import append_record, exclusive, rank_file, rank_files, read_records, write_atomic
from bridgelm.runs import dtype_name, local_source
from bridgelm.stop import stop_on_sigterm
from bridgelm.samples import check_lines, run_settings
from bridgelm.engine import SamplingConfig, stream_text
from bridgelm.tasks.base import check_rewards, is_correct

MAX_NEW_TOKENS = 2048  # tokens per warm-up response, at most: the paper's (App. A), the CLI's default too
# Problems need at least this many correct responses to be kept (a Bridge group has >= 2 rows).
MIN_CORRECT = 2


def make_warmup_data(
    model,
    tokenizer,
    task,
    out: str | os.PathLike,
    n: int = 8,
    sampling: SamplingConfig | None = None,
    chat: bool = False,
    limit: int | None = None,
    progress: bool = True,
    blocks: str | None = None,
    dist: Dist | None = None,
) -> dict:
    """Sample, grade and filter responses to `task.examples[:limit]` into `out`; returns counts (under torchrun,
    rank 0's count the whole output, another rank's its own part).

    `sampling` sets max_new_tokens, temperature, top_p, seed and batch bounds (default: the paper's 0.6 / 0.95
    with MAX_NEW_TOKENS new tokens); its n and width are replaced by `n` and 1.
    """
    out, dist = Path(out), dist or Dist.from_env()
    cfg = warmup_sampling(n, sampling, limit)
    examples = task.examples[:limit] if limit is not None else task.examples
    if not examples:
        raise UserError(f"task {task.name!r} has no examples to sample warm-up data from")
    model_id = local_source(str(getattr(model.config, "_name_or_path", "") or type(model).__name__))
    # blocks: the file the model's came from
    settings = run_settings("warmup-data", cfg, model_id, blocks, chat, dtype_name(model), task=task.name)
    own = rank_file(out, dist.rank, dist.world)  # out itself in one process
    with ExitStack() as locks:  # a second launch on `out` is refused at once: rank 0 locks it, each rank its part
        for path in dict.fromkeys([out, own] if dist.is_main else [own]):  # `out` first: a refusal names it
            locks.enter_context(exclusive(path, folder=False))
        stats = _make(model, tokenizer, task, examples, out, own, cfg, settings, chat, progress and dist.is_main, dist)
        if not dist.is_main:
            stats.update(_counts(read_records(own)))  # before the merge takes its part away
        barrier(dist, SLOWEST_RANK_TIMEOUT)  # every part is whole when this returns
        if dist.is_main:
            merge_parts(out, settings)
            stats.update(_counts(read_records(out)))
    return stats


def merge_parts(out: Path, settings: dict) -> None:
    """`out` with the lines of the parts beside it, each problem once, in the order of the problems (as one process
    writes them: a file, and an SFT run on it, that does not depend on where a run was stopped), in one atomic write;
    then the parts removed (a crash between the two leaves lines in both, read once). Every part's lines are checked
    against `settings` again: a part another launch wrote meanwhile is refused, not mixed in."""
    parts = rank_files(out)
    if not parts:
        return
    lines = {part: read_records(part) for part in [*reversed(parts), out]}  # `out`'s own line wins
    for part in parts:
        check_lines(part, lines[part], settings)
    records = {r["index"]: r for found in lines.values() for r in found}
    target = out.resolve() if out.is_symlink() else out  # a link stays one: its file is rewritten
    write_atomic(target, "".join(json.dumps(records[i], ensure_ascii=False) + "\n" for i in sorted(records)))
    for p in parts:
        p.unlink()


def warmup_sampling(n: int, sampling: SamplingConfig | None = None, limit: int | None = None) -> SamplingConfig:
    """The SamplingConfig of make_warmup_data's responses (`sampling` with `n` and width 1), or a UserError for the
    settings that cannot make warm-up data: the one check of the library and the command line, which calls it
    before the model loads."""
    if n < MIN_CORRECT:
        raise UserError(f"n={n} must be >= {MIN_CORRECT}: a kept problem needs {MIN_CORRECT} correct responses")
    base = (
        sampling if sampling is not None else SamplingConfig(max_new_tokens=MAX_NEW_TOKENS, temperature=0.6, top_p=0.95)
    )
    if base.width != 1:
        raise UserError(f"warm-up responses are sampled independently: width must be 1, got {base.width}")
    cfg = replace(base, n=n, width=1)
    cfg.validate()
    if limit is not None:
        check_int("limit", limit, note=" (left unset: every problem)")
    return cfg


def _make(model, tokenizer, task, examples, out: Path, own: Path, cfg, settings, chat, progress, dist: Dist) -> dict:
    """make_warmup_data's work for this process, under the locks: the lines of `out` and of every part are done,
    this process's share of the others is sampled into `own`."""
    done, before = [], 0
    for path in dict.fromkeys([out, own, *rank_files(out)]):
        mine = path == own or (path == out and dist.is_main)  # another rank's part may be written now: read, not cut
        lines = read_records(path, repair=mine)
        check_lines(path, lines, settings)
        _check_problems(path, lines, task, examples)
        done += lines
        before = len(lines) if path == own else before  # this process's lines so far
    have = {rec["index"] for rec in done}
    todo = [i for i in range(len(examples)) if dist.owns(i) and i not in have]
    stats = {"problems": len(examples), "sampled_now": len(todo), "out": str(out)}
    if todo:
        try:
            with stop_on_sigterm():  # SIGTERM as Ctrl-C: the problems written are said
                _sample_and_write(model, tokenizer, task, examples, todo, cfg, settings, chat, own, progress)
        except KeyboardInterrupt as err:
            err.said = True  # the command line adds no second line
            now = len(read_records(own)) - before
            share = f"of this process's {len(todo)} problems" if dist.world > 1 else f"of the {len(todo)} problems"
            total = "" if dist.world > 1 else f" ({len(have) + now} of {len(examples)} in all)"
            print(
                f"\nbridgelm warmup-data: interrupted; {now} {share} to sample were written to {own}{total}. A problem "
                f"is written once every answer of its wave has ended (--max-batch-sequences {cfg.max_batch_sequences} "
                "rows are sampled together, a smaller value writes sooner); the same command continues after the "
                "last one written",
                file=sys.stderr,
            )
            raise
    return stats


def _counts(records: list[dict]) -> dict:
    """Problems kept and dropped, their kept responses, correct ones cut, samples and empty ones, accuracy over all
    samples."""
    kept = [r for r in records if r.get("kept")]
    return {
        "kept": len(kept),
        "dropped": len(records) - len(kept),
        "responses": sum(len(r["responses"]) for r in kept),
        "cut": sum(r.get("cut", 0) for r in records),
        "empty": sum(r.get("empty", 0) for r in records),
        "samples": sum(r["n"] for r in records),
        "accuracy": sum(r["correct"] for r in records) / max(1, sum(r["n"] for r in records)),
    }


def _check_problems(out: Path, done: list[dict], task, examples) -> None:
    """UserError when a line of `out` was sampled from another problem than the one now at its index (another data
    file, or one edited since). Lines of files written before lines held a fingerprint are not checked."""
    for number, rec in enumerate(done, start=1):
        i = rec["index"]
        if "problem" in rec and i >= len(examples):
            raise UserError(
                f"{out}, line {number}: holds problem {i + 1}, but the data has {len(examples)} problems now (a lower "
                "--limit, or a shorter data file): expected at least as many as it was sampled from; use another --out"
            )
        if "problem" in rec and rec["problem"] != task.digest([examples[i]]):
            now = f"problem {i + 1} differs"
            raise UserError(
                f"{out}, line {number}: sampled from another problem than the data holds now ({now}): another data "
                "file, or one edited since; use another --out"
            )


def _sample_and_write(model, tokenizer, task, examples, todo, cfg, settings, chat, out, progress) -> None:
    texts = [task.prompt(examples[i]) for i in todo]
    title = f"warm-up data -> {out}" if progress else None
    for k, samples in stream_text(model, tokenizer, texts, cfg, keys=todo, chat=chat, progress=title):
        i = todo[k]
        example = examples[i]
        rewards = check_rewards(
            task.reward_many([(task.graded_text(s.text, s.finished), example) for s in samples]),
            f"task {task.name!r}, problem {i}",
        )
        correct = [j for j, r in enumerate(rewards) if is_correct(r)]
        good = [j for j in correct if samples[j].finished]
        record = {"index": i, "problem": task.digest([example])}  # its fingerprint: checked when the file resumes
        record.update(kept=len(good) >= MIN_CORRECT, correct=len(correct), n=cfg.n)
        if empty := sum(not s.text.strip() for s in samples):
            record["empty"] = empty  # (an Instruct model sampled without --chat often ends at once)
        if len(good) < len(correct):
            record["cut"] = len(correct) - len(good)  # correct but cut by max_new_tokens: not kept
        if record["kept"]:
            record.update(
                prompt=texts[k],
                prompt_ids=samples[0].prompt_ids,
                answer=task.answer(example),
                responses=[
                    {"text": samples[j].text, "token_ids": samples[j].token_ids, "finished": samples[j].finished}
                    for j in good
                ],
            )
        record["settings"] = settings
        append_record(out, record)
