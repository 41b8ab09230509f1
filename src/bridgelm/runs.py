"""Resumable outputs: format versions, the one settings check, and the fingerprints that tell data and models apart.

Every output that a re-run continues (a samples file, an eval run, a training run) records the settings that made
it, and a re-run with other settings is refused before anything is written, by `check_settings`: one line naming
each setting that differs, its saved value and the current one, and what to do instead.

Every kind of output records a format version (`FORMATS`); a folder or file of another version is refused in one line
(`check_format`). A training run may continue on a data file moved elsewhere with the same content: the data's
path is not compared when its fingerprint is (`COMPARED_BY_FINGERPRINT`). The model folder and block file a run
reads are recorded by content too (`source_digests`), so that one replaced at the same path is refused by name.
A training run's checkpoints are bridgelm.train.checkpoints'.

Used by bridgelm.samples, bridgelm.eval and bridgelm.train; tested by tests/test_train_common.py and
tests/test_bad_input.py.
"""
from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from bridgelm.errors import UserError

RUN_FILE = "run.json"  # the settings of a run folder (eval and training runs)
METRICS = "metrics.jsonl"  # a training run's metrics, one record per step

# ---------------------------------------------------------------------------------------------- formats

# The format version of each kind of output that a re-run continues or a reader reads, by the command that writes
# it; every run.json (and every line of a samples file, in its settings) records {"kind": ..., "format": ...}. A
# folder or file of another version is refused (`check_format`): this bridgelm is unreleased and reads only its own.
# generate, warmup-data 3 and rl 4: each sample's random stream its own (bridgelm.engine.randomness), so a run of an
# older version would resume with other draws; eval 5: run.json records the split its data folders were read at,
# and the dtype of the model's weights (`dtype_name`); generate and warmup-data 4: their lines record that dtype too.
FORMATS = {"eval": 5, "sft": 3, "rl": 4, "pretrain": 2, "generate": 4, "warmup-data": 4, "checkpoint": 3, "report": 1}


def dtype_name(model) -> str:
    """The dtype of `model`'s weights as a run records it ("float32", "bfloat16"): bf16 samples are other samples
    than fp32 ones, so a re-run in another dtype is refused rather than mixed in."""
    return str(next(model.parameters()).dtype).removeprefix("torch.")


def format_of(kind: str) -> dict[str, Any]:
    """The head of a run.json (or of a samples line's settings) of `kind`: {"kind", "format"}."""
    return {"kind": kind, "format": FORMATS[kind]}


def run_kind(recorded: Any) -> str | None:
    """The kind a parsed run.json (or a samples line's settings) records ("eval", "sft", ...), or None."""
    return recorded.get("kind") if isinstance(recorded, dict) else None


def refuse_run_folder(folder: str | os.PathLike, command: str, resumable: bool = False) -> Any:
    """UserError when `folder` holds the run.json of a run other than `command`'s own (with `resumable`: a run of
    kind `command`, continued; else none: the demo's folders are of another layout): its outputs would mix with
    that run's. Returns the parsed run.json (None: none there)."""
    path = Path(folder) / RUN_FILE
    if not path.is_file():
        return None
    try:
        run = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        run = None
    found = run_kind(run)
    if resumable and found == command:
        return run
    what = f"a bridgelm {found} run" if found else "a run.json of something else"
    raise UserError(
        f"{folder} already holds {what} ({path}): expected a new folder, or one of `bridgelm {command}` to "
        f"{'resume' if resumable else 'run again'}; use another --out"
    )


def check_run_folder(folder: str | os.PathLike, command: str, flag: str = "--out") -> None:
    """UserError, before any work, when `folder` holds files but no run.json: what no bridgelm run wrote there (a
    model's or another run's files, one's own notes), which a new run would overwrite or mix with. Hidden entries
    (bridgelm's locks among them) are not counted."""
    path = Path(folder).expanduser()
    if not path.is_dir() or (path / RUN_FILE).exists():
        return
    found = sorted(e.name for e in path.iterdir() if not e.name.startswith("."))
    if found:
        shown = ", ".join(found[:4]) + (f" and {len(found) - 4} more" if len(found) > 4 else "")
        raise UserError(
            f"{flag} {folder} holds {shown} but no {RUN_FILE} of a bridgelm {command} run: expected a new or empty "
            "folder, or a run's own to resume; use another --out"
        )


def check_format(where: str | os.PathLike, recorded: Any, kind: str, expected: str) -> None:
    """UserError in one line unless `recorded` (a parsed run.json, or a samples line's settings) is this bridgelm's
    format of `kind`: it names another kind of output and `expected` (what was expected instead: "a folder made by
    bridgelm eval --out"), or the older format version found, the version expected and what to do."""
    if not isinstance(recorded, dict):
        raise UserError(f"{where} is not a bridgelm output: expected {expected}")
    found, version = recorded.get("kind"), recorded.get("format")
    if found is not None and found != kind:
        what = "training run" if found in ("sft", "rl", "pretrain") else "output"
        raise UserError(f"{where} is a bridgelm {found} {what}: expected {expected}")
    if version != FORMATS[kind]:
        has = "no format version" if version is None else f"format version {version!r}"
        newer = isinstance(version, int) and not isinstance(version, bool) and version > FORMATS[kind]
        raise UserError(
            f"{where} has {has} (written by {'a newer' if newer else 'an older'} bridgelm), and bridgelm {kind} reads "
            f"version {FORMATS[kind]} only: start a new --out"
        )


# ---------------------------------------------------------------------------------------------- settings

# The sampling settings that decide what is sampled: two runs (or a run and its re-run) that differ in one of them
# hold samples of different distributions. The one list: an eval re-run must match them all (`widths` in place of
# `width`), a samples file records them, and a report compares its rows on all but `width` and `seed`.
SAMPLED_WITH = (
    "n",
    "width",
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "chat",
    "stop",
    "foreign_groups",
)


def check_settings(
    where: str | os.PathLike,
    saved: dict,
    now: dict,
    keys: Iterable[str] | None = None,
    saved_as: str = "saved",
    describe: dict[str, Callable[[Any, Any], str]] | None = None,
    why: str = "",
    fix: str = "use another --out",
) -> None:
    """UserError naming every setting in `keys` (default: all of both) whose saved value differs from the current.

    The message reads "WHERE was written with other settings (K: SAVED_AS a vs now b; ...)WHY; FIX". `describe`
    maps a setting to a function (saved, now) -> text that tells its difference better (e.g. which data changed).
    A setting of COMPARED_BY_FINGERPRINT is left to its fingerprint when that is compared too.
    """
    keys = sorted(set(saved) | set(now)) if keys is None else list(keys)
    describe = {**DESCRIBE, **(describe or {})}
    diffs = []
    for k in keys:
        if COMPARED_BY_FINGERPRINT.get(k) in keys:
            continue  # a data file moved elsewhere with the same content is the same data
        path_key = k.removesuffix("_digest")
        if k in SOURCE_DIGESTS and path_key in keys and saved.get(path_key) != now.get(path_key):
            continue  # another file than the run's: its path says so, and its content did not "change"
        if saved.get(k) != now.get(k):
            tell = describe.get(k)
            diffs.append(
                tell(saved.get(k), now.get(k)) if tell else f"{k}: {saved_as} {saved.get(k)!r} vs now {now.get(k)!r}"
            )
    if diffs:
        raise UserError(f"{where} was written with other settings ({'; '.join(diffs)}){why}; {fix}")


def local_source(path: str | os.PathLike | None) -> str | None:
    """An existing local path made absolute, so that runs started from other folders (`m`, `./m`, `/abs/m`) record
    the same model or file; anything else (a hub id) as given; None (or "": no file, e.g. no blocks) as None."""
    if not path:
        return None
    p = Path(path).expanduser()
    return str(p.resolve()) if p.exists() else str(path)


def fingerprint(items: Iterable[Any]) -> str:
    """A "sha256:..." fingerprint of JSON-able `items` in order (a run's problems), recorded as `digest`: other or
    edited data cannot be mixed into a run or resume it."""
    h = hashlib.sha256()
    for item in items:
        h.update(json.dumps(item, ensure_ascii=False).encode())
    return "sha256:" + h.hexdigest()[:32]


def file_fingerprint(path: str | os.PathLike | None) -> str | None:
    """"sha256:..." of a file's bytes (a block file: small next to its model), recorded as `blocks_digest`; None for
    no file (or none there: a name given only to be recorded)."""
    if not path or not Path(path).expanduser().is_file():
        return None
    h = hashlib.sha256()
    with open(Path(path).expanduser(), "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return "sha256:" + h.hexdigest()[:32]


def model_fingerprint(name_or_path: str | os.PathLike | None) -> str | None:
    """A cheap fingerprint of a local model folder, recorded as `model_digest`: sha256 over its config.json's bytes
    and the name, size and mtime_ns of every other file that loading it reads (weights, tokenizer: `_model_file`;
    not outputs kept beside them); None for a hub id (or no model).

    Not the weights' bytes: tens of GB to read at every start and resume. Nor the safetensors headers: a model
    trained further and saved over the folder keeps its tensor names, shapes and dtypes, so its header, while every
    rewrite of a file changes its mtime. A folder copied without its times (`cp` without `-p`) reads as changed.
    """
    folder = Path(name_or_path).expanduser() if name_or_path else None
    if folder is None or not folder.is_dir():
        return None
    h = hashlib.sha256()
    for p in sorted(folder.iterdir()):
        if not (_model_file(p.name) and p.is_file()):
            continue
        st = p.stat()
        h.update(p.read_bytes() if p.name == "config.json" else f"{p.name}:{st.st_size}:{st.st_mtime_ns}".encode())
        h.update(b"\0")
    return "sha256:" + h.hexdigest()[:32]


# Files of a model folder that loading it reads: its configs, weights (and their index) and tokenizer files.
_MODEL_FILE_HEADS = ("config.json", "generation_config.json", "tokenizer", "special_tokens", "added_tokens", "vocab",
                     "merges", "chat_template")


def _model_file(name: str) -> bool:
    return name.startswith(_MODEL_FILE_HEADS) or name.endswith((".safetensors", ".bin", ".safetensors.index.json"))


def source_digests(model: str | os.PathLike | None, blocks: str | os.PathLike | None) -> dict[str, str | None]:
    """The fingerprints of the model folder and the block file a run reads (SOURCE_DIGESTS): a run records them
    beside their paths, so that a file replaced at the same path (sft's best blocks, rl's best/) is refused by name
    instead of resuming the run with other weights."""
    return {"model_digest": model_fingerprint(model), "blocks_digest": file_fingerprint(blocks)}


# The settings `source_digests` records (eval runs, samples files, training runs).
SOURCE_DIGESTS = ("model_digest", "blocks_digest")


def _changed(what: str, since: str) -> Callable[[Any, Any], str]:
    """How check_settings tells a changed fingerprint of `what` ("model", "blocks")."""

    def tell(saved: Any, now: Any) -> str:
        if saved is None or now is None:
            return f"{what}_digest: saved {saved!r} vs now {now!r}"
        return f"{what}: the {since} changed since the run began ({saved} vs now {now})"

    return tell


# A feature of resuming: a data file moved elsewhere with the same content continues the run. Its path (the setting)
# is not compared when its content's fingerprint (the value here) is: a training run records both.
COMPARED_BY_FINGERPRINT = {"data": "digest"}
# How check_settings tells some differences.
DESCRIBE: dict[str, Callable[[Any, Any], str]] = {
    "digest": lambda saved, now: (
        f"digest: the data's fingerprint changed ({saved} vs now {now}): another data file, or one edited since"
    ),
    "validation": lambda saved, now: (
        f"validation: the validation problems changed ({saved} vs now {now}): another --val-task/--val-data or "
        "--eval-limit, and best/ would compare accuracies on different sets"
    ),
    "model_digest": _changed("model", "folder (its config.json, or a file's size or modification time)"),
    "blocks_digest": _changed("blocks", "file"),
    "processes": lambda saved, now: (
        f"processes: the run ran in {saved} process(es), now {now}: each rank draws its own rollouts, so another "
        "count would not continue the same run"
    ),
    "initial_checksum": lambda saved, now: (
        f"initial_checksum: the weights the run started from summed to {saved}, the ones given now to {now}: "
        "another --blocks file, or a model or block file changed since"
    ),
}


def jsonable(obj: Any) -> Any:
    """Settings as JSON round-trips them (tuples -> lists), so that saved and current settings compare equal."""
    return json.loads(json.dumps(obj))
