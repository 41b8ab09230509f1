"""Resumable outputs: the one settings check, atomic folders, and the checkpoints of a training run.

Every output that a re-run continues (a samples file, an eval run, a training run) records the settings that made
it, and a re-run with other settings is refused before anything is written, by `check_settings`: one line naming
each setting that differs, its saved value and the current one, and what to do instead.

A training run folder holds run.json, metrics.jsonl (one record per step) and checkpoints/step-NNNNNNNN/, each
written under a temporary name and renamed (`write_dir_atomic`); trainer.json is written last and marks a checkpoint
whole; the last N are kept (`prune_checkpoints`). Trainer state (optimiser, scheduler, RNG, step, plain extras) is a
torch file read back with `weights_only=True`. Under FSDP the model and optimiser are in SHARDS instead, each rank's
own (torch.distributed.checkpoint), and trainer.json records the layout (`check_layout`). A resume first checks the
files of the newest checkpoint (JSON, safetensors headers and sizes, the checksums of trainer_state.pt's zip, the
shards' metadata); a damaged one is named and passed over for the previous whole one, which a resumed run continues
from exactly (`resume_point`).

Every kind of output records a format version (`FORMATS`); a folder or file of another version is refused in one line
(`check_format`). A training run may continue on a data file moved elsewhere with the same content: the data's
path is not compared when its fingerprint is (`COMPARED_BY_FINGERPRINT`). The model folder and block file a run
reads are recorded by content too (`source_digests`), so that one replaced at the same path is refused by name.

Used by bridgelm.samples, bridgelm.evaluate and bridgelm.train; tested by tests/test_train_common.py and
tests/test_bad_input.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import shutil
import warnings
import zipfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from bridgelm.errors import DataWarning, UserError
from bridgelm.jsonl import json_kind, read_json_object
from bridgelm.rng import rng_state

RUN_FILE = "run.json"  # the settings of a run folder (eval and training runs)
METRICS = "metrics.jsonl"  # a training run's metrics, one record per step
CHECKPOINTS = "checkpoints"  # folder of the step-NNNNNNNN checkpoints inside a training run folder
TRAINER_STATE = "trainer_state.pt"  # optimiser, scheduler, RNG and step of a checkpoint
TRAINER_INFO = "trainer.json"  # step, settings and run facts of a checkpoint (written last: marks it complete)
SHARDS = "shards"  # under FSDP: each rank's shards of model and optimiser in a checkpoint (torch.dist. checkpoint)
LAYOUTS = {False: "whole", True: "sharded"}  # a checkpoint's layout by whether its run shards the model (FSDP)

# ---------------------------------------------------------------------------------------------- formats

# The format version of each kind of output that a re-run continues or a reader reads, by the command that writes
# it; every run.json (and every line of a samples file, in its settings) records {"kind": ..., "format": ...}. A
# folder or file of another version is refused (`check_format`): this bridgelm is unreleased and reads only its own.
FORMATS = {"eval": 2, "sft": 2, "rl": 2, "pretrain": 2, "generate": 2, "warmup-data": 2, "checkpoint": 3}


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
        raise UserError(
            f"{where} has {has} (written by an older bridgelm), and bridgelm {kind} reads version {FORMATS[kind]} "
            "only: start a new --out"
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
}


def jsonable(obj: Any) -> Any:
    """Settings as JSON round-trips them (tuples -> lists), so that saved and current settings compare equal."""
    return json.loads(json.dumps(obj))


def write_dir_atomic(final: str | os.PathLike, write: Callable[[Path], None]) -> Path:
    """Let `write(tmp)` fill a temporary directory, then rename it to `final` (replacing an older one)."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        write(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if final.exists():
        old = final.with_name(f".{final.name}.old{os.getpid()}")
        if old.exists():
            shutil.rmtree(old)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    return final


# ---------------------------------------------------------------------------------------------- checkpoints


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


def list_checkpoints(out_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoints of a run directory (those whose trainer.json exists), oldest first. Only folders named
    as `checkpoint_name` names them count: a copy such as step-2x is no checkpoint to resume from, announce or prune."""
    folder = Path(out_dir) / CHECKPOINTS
    if not folder.is_dir():
        return []
    found = [p for p in folder.glob("step-*") if re.fullmatch(r"step-[0-9]{8,}", p.name) and p.is_dir()
             and (p / TRAINER_INFO).is_file()]
    return sorted(found, key=lambda p: int(p.name[5:]))


def latest_checkpoint(out_dir: str | os.PathLike) -> Path | None:
    found = list_checkpoints(out_dir)
    return found[-1] if found else None


def prune_checkpoints(out_dir: str | os.PathLike, keep_last: int) -> None:
    """Delete all but the newest `keep_last` checkpoints (keep_last <= 0 keeps all)."""
    if keep_last <= 0:
        return
    for old in list_checkpoints(out_dir)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


def save_trainer_state(
    folder: Path, step: int, optimizer_sd: dict | None, scheduler, extra: dict | None = None
) -> None:
    """trainer_state.pt: step, optimiser (None: it is in SHARDS) and scheduler states, RNG states, and `extra`
    (plain values)."""
    state = {
        "step": step,
        "optimizer": optimizer_sd,
        "scheduler": scheduler.state_dict(),
        "rng": rng_state(),
        "extra": extra or {},
    }
    tmp = folder / f".{TRAINER_STATE}.tmp"
    torch.save(state, tmp)
    os.replace(tmp, folder / TRAINER_STATE)


def load_trainer_state(folder: str | os.PathLike) -> dict:
    """trainer_state.pt of a checkpoint, read with weights_only=True; a file holding anything else is refused."""
    path = Path(folder) / TRAINER_STATE
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {folder} has no {TRAINER_STATE}")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise UserError(
            f"{path} holds objects other than tensors and plain values, so it was not loaded (loading them could "
            "run code): expected a trainer_state.pt written by bridgelm; do not resume from a checkpoint you did "
            "not write"
        ) from err
    except (RuntimeError, EOFError, OSError) as err:
        raise UserError(f"{path} is damaged ({str(err).splitlines()[0]}): expected a whole trainer_state.pt") from err


def checkpoint_damage(folder: str | os.PathLike) -> str | None:
    """What is wrong with a checkpoint's files (cut, damaged, missing), or None when they read back whole.

    Checks trainer.json, the shards of an FSDP checkpoint (`bridgelm.shards.shards_damage`: index and file sizes;
    an index that is not DCP's is refused, not passed over), the headers and sizes of the *.safetensors files and
    the checksums of trainer_state.pt;
    the data of a safetensors file carries no checksum, so a flipped bit there goes unnoticed.
    """
    from safetensors import safe_open

    folder = Path(folder)
    try:
        info = json.loads((folder / TRAINER_INFO).read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        return f"{TRAINER_INFO}: {err}"
    if not isinstance(info, dict):
        return f"{TRAINER_INFO}: holds a JSON {json_kind(info)}, not an object"
    if (folder / SHARDS).is_dir() or info.get("layout") == LAYOUTS[True]:
        from bridgelm.shards import shards_damage  # an index that is not DCP's is refused (UserError), not skipped

        damage = shards_damage(folder / SHARDS)
        if damage is not None:
            return damage
    for weights in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(weights), framework="pt"):
                pass
        except Exception as err:  # safetensors has its own error type for every kind of damage
            return f"{weights.name}: {err}"
    state = folder / TRAINER_STATE
    try:
        with zipfile.ZipFile(state) as z:
            bad = z.testzip()
    except (OSError, zipfile.BadZipFile) as err:
        return f"{TRAINER_STATE}: {err}"
    return f"{TRAINER_STATE}: entry {bad} fails its checksum" if bad else None


def check_layout(folder: str | os.PathLike, sharded: bool) -> None:
    """UserError in one line unless the checkpoint `folder` is of this bridgelm's format and of the layout a run that
    shards its model (`sharded`: FSDP) or does not reads: shards of every rank, or whole weights and optimiser."""
    info = read_info(folder)
    check_format(folder, info, "checkpoint", expected="a checkpoint folder written by bridgelm")
    want = LAYOUTS[sharded]
    if info.get("layout") != want:
        flag = "with --fsdp" if info.get("layout") == "sharded" else "without --fsdp"
        raise UserError(
            f"checkpoint {folder} holds {info.get('layout')} training state, and this run reads {want} state: "
            f"resume it {flag}"
        )


def read_info(folder: str | os.PathLike) -> dict:
    return read_json_object(Path(folder) / TRAINER_INFO, "a checkpoint's trainer.json written by bridgelm")


def resume_point(out_dir: Path, resume: bool) -> Path | None:
    """The checkpoint to resume from (None: start afresh). Refuses to start afresh over an earlier run."""
    latest = latest_checkpoint(out_dir)
    if not resume and (latest is not None or (out_dir / METRICS).exists()):
        raise ValueError(
            f"{out_dir} already holds a run ({latest or out_dir / METRICS}); pass resume=True (--resume) "
            "to continue it, or choose another output directory"
        )
    if latest is None:
        return None
    damage = checkpoint_damage(latest)
    if damage is None:
        return latest
    for earlier in reversed(list_checkpoints(out_dir)[:-1]):
        if checkpoint_damage(earlier) is None:
            warnings.warn(
                f"checkpoint {latest} is damaged ({damage}); resuming from the previous one, {earlier} (the run "
                "recomputes the steps after it exactly)",
                DataWarning,
                stacklevel=2,
            )
            return earlier
    raise UserError(
        f"checkpoint {latest} is damaged ({damage}) and no earlier checkpoint of {out_dir} is whole: expected a "
        "checkpoint to resume from; start afresh with another output directory"
    )
