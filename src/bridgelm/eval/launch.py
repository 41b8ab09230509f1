"""The evaluation commands as calls: `run_evaluate` (bridgelm eval), `run_score`, `run_report`, and `run_features`,
`run_siblings`, `run_similarity` (bridgelm analyze ...) do what the commands do, for the command line and a Python
user alike: check the output before any work, load what they name, run, write, and say what they wrote.
"""

from __future__ import annotations

import json
from pathlib import Path

from bridgelm.attach import has_block_type
from bridgelm.errors import UserError
from bridgelm.eval.runner import EvalConfig
from bridgelm.jsonl import check_out, read_json_object, write_json
from bridgelm.models import load_config
from bridgelm.runs import check_run_folder, run_kind
from bridgelm.samples import greedy_note, kept_on_interrupt
from bridgelm.source import ModelSource, width_is_moot


def run_evaluate(cfg: EvalConfig, source: ModelSource, task: str, data: list[str], out: str, score: bool = True):
    """`bridgelm eval`: `cfg.sampling.n` responses per problem of each data file of `task` (a benchmark each) at
    every width into the run folder `out` (re-runs resume; under torchrun a shard a rank), scored on rank 0 unless
    not `score`. Returns run_eval's counts."""
    from bridgelm.dist import Dist
    from bridgelm.eval.datasets import load_benchmarks
    from bridgelm.eval.folder import shard_file_name
    from bridgelm.eval.runner import sample_benchmarks
    from bridgelm.jsonl import check_free

    cfg.validate()
    check_out(out, "dir")
    check_run_folder(out, "eval")
    benches = load_benchmarks(task, data, cfg.limit, cfg.split)  # data errors before the model is loaded
    dist = Dist.from_env(source.device)  # under torchrun a cuda source loads on each rank's own GPU
    if dist.is_main:  # another eval (or score) writing the run: refused before the model loads
        check_free(out, folder=True)
    check_free(Path(out) / shard_file_name(dist), folder=False)
    if dist.is_main and (note := greedy_note(cfg.sampling)):
        print(f"bridgelm eval: {note}")
    if dist.is_main and cfg.main_width() != cfg.sampling.width:
        print(f"bridgelm eval: note: --width {cfg.sampling.width} (the width tables report) is not among --widths "
              f"{','.join(map(str, cfg.all_widths()))}: they report w={cfg.main_width()}, the widest")
    if dist.is_main:
        names = ", ".join(f"{b.name} ({len(b.problems)})" for b in benches)
        print(
            f"bridgelm eval: {names} x widths {cfg.all_widths()} x {cfg.sampling.n} samples -> {out}/ "
            f"(run.json, samples{'.rank*' if dist.world > 1 else ''}.jsonl"
            f"{', scores.jsonl, metrics.json' if score else ''})"
        )
    model, tokenizer = source.load()
    what = width_is_moot(model)
    if dist.is_main and what and len(cfg.all_widths()) > 1:
        print(
            f"bridgelm eval: note: {what}, so its samples do not depend on the width: widths {cfg.all_widths()} "
            "sample the same sets (up to the rounding of other batch shapes), each again"
        )
    elif dist.is_main and what and cfg.main_width() > 1:  # a forgotten --blocks: its tables would say w=8
        print(f"bridgelm eval: note: {what}, so width {cfg.main_width()} samples like width 1: independently")
    if dist.is_main and cfg.sampling.foreign_groups and (what or max(cfg.all_widths()) == 1):
        why = f"{what}, so no sample reads another" if what else "at width 1 a sample has no siblings"
        print(f"bridgelm eval: note: --foreign-groups changes nothing here: {why}")
    with kept_on_interrupt("bridgelm eval", "problems", out):
        done = sample_benchmarks(model, tokenizer, benches, task, cfg, out, source.model, source.blocks, dist=dist)
    _say_sampled(done, cfg, out, f"rank {dist.rank}: " if dist.world > 1 else "")
    if dist.is_main and score:
        run_score(out, command="eval")
    elif dist.is_main:
        _drop_stale_scores(Path(out))
    return done


def _drop_stale_scores(run_dir: Path) -> None:
    """Scores of an earlier, partial state of the run (`score --allow-partial`, `analyze similarity`) that samples
    added since make wrong (report would read them): removed, and said; `bridgelm score` writes them again."""
    from bridgelm.eval.folder import shard_files
    from bridgelm.eval.score import METRICS_FILE, SCORES_FILE
    from bridgelm.eval.tables import SIMILARITY_FILE

    newest = max((p.stat().st_mtime_ns for p in shard_files(run_dir)), default=0)
    stale = [p for p in (run_dir / n for n in (METRICS_FILE, SCORES_FILE, SIMILARITY_FILE))
             if p.is_file() and p.stat().st_mtime_ns < newest]
    for p in stale:
        p.unlink()
    if stale:
        print(f"bridgelm eval: removed {', '.join(p.name for p in stale)} of the run before these samples (stale "
              f"now): `bridgelm score {run_dir}` writes them again")


def _say_sampled(done: dict, cfg: EvalConfig, out: str, who: str) -> None:
    widths = len(cfg.all_widths())
    what = "problems" if widths == 1 else f"sets (a problem at one of {widths} widths)"
    print(f"bridgelm eval: {who}sampled {done['sampled']} {what} now, {done['skipped']} were already in {out}")
    if done["truncated"]:
        print(
            f"bridgelm eval: {who}the long document of {done['truncated']} of them was cut to fit the context minus "
            "--max-new-tokens (recorded as 'truncated' on its line of the samples file)"
        )


def run_score(run_dir: str, allow_partial: bool = False, command: str = "score") -> dict:
    """`bridgelm score`: grade the samples of an eval run into its metrics.json and scores.jsonl; returns the
    metrics. An unfinished run is refused unless `allow_partial` (then its missing problems are listed)."""
    from bridgelm.eval.score import METRICS_FILE, SCORES_FILE, score_run, summary_lines

    result = score_run(run_dir, allow_partial=allow_partial)
    run = Path(run_dir)
    if command == "score":
        print(f"bridgelm score: {run / METRICS_FILE}, {run / SCORES_FILE}")
    else:
        print(f"bridgelm {command}: metrics -> {run / METRICS_FILE}")
    for line in summary_lines(result):
        print(f"bridgelm {command}: {line}")
    return result


def run_report(run_dirs: list[str], out: str, names: list[str] | None = None, base: str | None = None) -> Path:
    """`bridgelm report`: tables (markdown) and figures (PNG) over scored runs into the folder `out`; `names` names
    the rows (equal names merge runs), `base` the row the improvement column compares with. Returns table.md."""
    from bridgelm.eval.report import check_report_out, write_report

    check_out(out, "dir")
    check_report_out(out, run_dirs)
    path = write_report(run_dirs, out, names=names, base=base)
    report = json.loads((Path(out) / "report.json").read_text())
    files = ", ".join(Path(f).name for f in report["files"])
    print(f"bridgelm report: {path} (and report.json{', ' + files if files else ''} in {out})")
    for line in report["setting_differences"]:
        print(f"bridgelm report: warning: {line}")
    acc = report["accuracy"]
    for name, row in acc["rows"].items() if acc["columns"] else ():  # ROUGE-only runs: the non-math lines below
        lacks = [b for b, cell in row["cells"].items() if cell is None]  # no mean over benchmarks it lacks
        avg = f"– (not scored on {', '.join(lacks)})" if row["avg"] is None else f"{100 * row['avg']:.2f}%"
        delta = "" if row["delta"] is None else f" (Δ {100 * row['delta']:+.2f} vs {acc['base']})"
        print(f"bridgelm report: {name}: mean accuracy {avg}{delta}")
    table2 = report.get("nonmath")
    for name, cells in (table2 or {}).get("rows", {}).items():
        shown = [f"{table2['titles'][b]} {100 * cells[b]['mean']:.2f}" for b in table2["columns"] if cells.get(b)]
        if shown:
            print(f"bridgelm report: {name}: non-math (ROUGE-1 / accuracy, %): {', '.join(shown)}")
    return path


def _check_analysis_out(out: str, name: str, identity: dict) -> None:
    """--out of an analysis: a folder of its own (not another command's run folder), and not one holding the same
    analysis of another model, run or selection of response sets (a re-run of the same one replaces it)."""
    check_out(out, "dir")
    folder = Path(out)
    if (folder / "run.json").is_file():
        kind = run_kind(read_json_object(folder / "run.json", "a bridgelm run.json")) or "unknown"
        raise UserError(f"--out {out} holds a bridgelm {kind} run: expected a folder of the analysis's own")
    if (folder / name).is_file():
        earlier = read_json_object(folder / name, f"a {name} of bridgelm analyze")
        other = {k: v for k, v in identity.items() if earlier.get(k) != v}
        if other:
            was = ", ".join(f"{k} {earlier.get(k)!r}" for k in other)
            raise UserError(f"--out {out} holds the {name} of another analysis ({was}): use another --out")


def _require_blocks(source: ModelSource) -> None:
    """An analysis of blocks refuses a model without any before it loads (the analyses say it again in Python)."""
    if source.blocks is None and not has_block_type(load_config(source.model)):
        raise UserError(
            f"{source.model} has no Bridge or P-Match blocks and no --blocks were given: its samples cannot read each "
            "other, so there is nothing of blocks to measure; expected a model with blocks"
        )


def run_features(source: ModelSource, run: str, out: str, sets: int = 8, benchmark: str | None = None,
                 width: int | None = None, max_tokens: int = 4096) -> dict:
    """`bridgelm analyze features`: ||block output|| / ||residual|| per layer over `sets` response sets of the eval
    run `run`, re-run through the model of `source`, into OUT/features.json and features.png."""
    from bridgelm.eval.analyze import plot_feature_ratios, run_feature_ratios
    from bridgelm.eval.folder import check_run_model

    selection = {"sets": sets, "benchmark": benchmark, "width": width, "max_tokens": max_tokens}  # as asked
    identity = {"model": source.model, "blocks": source.blocks, "run": str(run), "selection": selection}
    _check_analysis_out(out, "features.json", identity)
    _require_blocks(source)
    check_run_model(run, source.model, source.blocks)
    model = source.load_model()
    folder = Path(out)
    print(f"bridgelm analyze features: {sets} response sets of {run} -> {folder}/features.json, features.png")
    result = run_feature_ratios(model, run, sets, benchmark, width, max_tokens)
    result.update(identity)
    write_json(folder / "features.json", result)
    plot_feature_ratios({f"{result['kind']} ({Path(source.model).name})": result["ratios"]}, folder / "features.png")
    ratios = ", ".join(f"{r:.4f}" for r in result["ratios"])
    print(f"bridgelm analyze features: {result['kind']} ratio per layer over {result['tokens']} tokens: {ratios}")
    return result


def run_siblings(source: ModelSource, out: str, run: str | None = None, data: str | None = None, sets: int = 64,
                 benchmark: str | None = None, width: int | None = None, max_tokens: int = 4096) -> dict:
    """`bridgelm analyze siblings`: the NLL of response sets (of the eval run `run`, or the warm-up file `data`)
    with their siblings as a group against each alone, under the model of `source`, into OUT/siblings.json."""
    from bridgelm.eval.analyze import run_response_sets, sibling_gain, warmup_response_sets
    from bridgelm.eval.folder import check_run_model

    if (run is None) == (data is None):
        raise UserError("give one of --run (an eval run) or --data (a warm-up file)")
    selection = {"sets": sets, "benchmark": benchmark, "width": width, "max_tokens": max_tokens}  # as asked
    identity = {"model": source.model, "blocks": source.blocks, "source": str(run or data), "selection": selection}
    _check_analysis_out(out, "siblings.json", identity)
    _require_blocks(source)
    if run is not None:
        check_run_model(run, source.model, source.blocks)
        response_sets = run_response_sets(run, sets, benchmark, width, max_tokens)
    else:
        response_sets = warmup_response_sets(data, sets)
    model = source.load_model()
    path = Path(out) / "siblings.json"
    print(f"bridgelm analyze siblings: {len(response_sets)} response sets of {run or data} -> {path}")
    result = sibling_gain(model, response_sets)
    result.update(identity)
    write_json(path, result)
    d = result["diff"]
    print(
        f"bridgelm analyze siblings: NLL per response token {result['nll_with_siblings']:.5f} with siblings, "
        f"{result['nll_alone']:.5f} alone: {d['mean']:+.5f} [{d['low']:+.5f}, {d['high']:+.5f}] over "
        f"{result['sets']} sets ({result['tokens']} tokens; negative: the siblings help)"
    )
    return result


def run_similarity(run_dir: str, out: str | None = None, benchmark: str | None = None, width: int | None = None,
                   max_samples: int | None = None, embedding_model: str | None = None) -> dict:
    """`bridgelm analyze similarity`: mean pairwise ROUGE-L and ROUGE-1 (and embedding cosine: `embedding_model`,
    None the default MiniLM, '' none) within the response sets of an eval run, into `out` (RUN_DIR/similarity.json)."""
    from bridgelm.eval.similarity import DEFAULT_EMBEDDER, run_similarity as similarity

    path = Path(out) if out else Path(run_dir) / "similarity.json"
    if path.suffix != ".json":
        raise UserError(f"--out {out}: expected a .json file to write (default RUN/similarity.json, which bridgelm "
                        "report reads), not a folder")
    check_out(str(path), "file")
    subset = [f"--{k.replace('_', '-')} {v}" for k, v in
              (("benchmark", benchmark), ("width", width), ("max_samples", max_samples)) if v is not None]
    if subset and not out:
        raise UserError(f"{', '.join(subset)} measures part of the run, and RUN/similarity.json (the default --out) is "
                        "what bridgelm report reads as the whole run's: expected --out FILE.json for the part")
    embedder = DEFAULT_EMBEDDER if embedding_model is None else (embedding_model or None)
    result = similarity(run_dir, benchmark, width, max_samples, embedder, path)
    print(f"bridgelm analyze similarity: -> {path}")
    for bench, per in result.items():
        for w, entry in per.items():
            r, r1 = entry["rouge_l"], entry["rouge_1"]
            emb = entry.get("embedding", {})
            tail = f", embedding cosine {emb['cosine']['mean']:.4f}" if "cosine" in emb else ""
            skipped = f" (embedding skipped: {emb['skipped']})" if "skipped" in emb else ""
            print(
                f"bridgelm analyze similarity: {bench} w={w}: ROUGE-L {r['mean']:.4f} "
                f"[{r['low']:.4f}, {r['high']:.4f}], ROUGE-1 {r1['mean']:.4f} "
                f"over {entry['problems']} sets{tail}{skipped}"
            )
    return result
