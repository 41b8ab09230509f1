"""The checkpoints of a training run: written whole or not at all, listed, pruned, checked and resumed from.

A training run folder holds run.json, metrics.jsonl (one record per step) and checkpoints/step-NNNNNNNN/, each
written under a temporary name and renamed (`write_dir_atomic`); trainer.json is written last and marks a checkpoint
whole; the last N are kept (`prune_checkpoints`). Trainer state (optimiser, scheduler, RNG, step, plain extras) is a
torch file read back with `weights_only=True`. Under FSDP the model and optimiser are in SHARDS instead, each rank's
own (torch.distributed.checkpoint), and trainer.json records the layout (`check_layout`). A resume first checks the
files of the newest checkpoint (JSON, safetensors headers and sizes, the checksums of trainer_state.pt's zip, the
shards' metadata); a damaged one is named and passed over for the previous whole one, which a resumed run continues
from exactly (`resume_point`).

Used by bridgelm.train.loop, bridgelm.train.agree and bridgelm.train.weights; tested by tests/test_train_common.py,
tests/test_bad_input.py and tests/test_hostile_3.py.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path

import torch

from bridgelm.errors import DataWarning, MissingFile, UserError
from bridgelm.jsonl import as_umask, json_kind, read_json_object
from bridgelm.rng import rng_state
from bridgelm.runs import METRICS, check_format

CHECKPOINTS = "checkpoints"  # folder of the step-NNNNNNNN checkpoints inside a training run folder
TRAINER_STATE = "trainer_state.pt"  # optimiser, scheduler, RNG and step of a checkpoint
TRAINER_INFO = "trainer.json"  # step, settings and run facts of a checkpoint (written last: marks it complete)
SHARDS = "shards"  # under FSDP: each rank's shards of model and optimiser in a checkpoint (torch.dist. checkpoint)
LAYOUTS = {False: "whole", True: "sharded"}  # a checkpoint's layout by whether its run shards the model (FSDP)


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
        as_umask(tmp)
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
    """Delete all but the newest `keep_last` checkpoints (keep_last <= 0 keeps all): each renamed out of the
    checkpoints' names first, so that a process killed while deleting leaves a leftover `sweep_leftovers` removes,
    not a checkpoint without its trainer.json that nothing lists."""
    if keep_last <= 0:
        return
    for old in list_checkpoints(out_dir)[:-keep_last]:
        gone = old.with_name(f".{old.name}.old{os.getpid()}")
        try:
            if gone.exists():  # an earlier process of this pid left it
                shutil.rmtree(gone, ignore_errors=True)
            os.replace(old, gone)
        except OSError:  # pruning is best-effort: a folder that cannot be renamed is deleted where it is
            gone = old
        shutil.rmtree(gone, ignore_errors=True)


# what a process killed while writing or pruning leaves: write_dir_atomic's and prune's folders (of a checkpoint, rl's
# best/, sft's best model/: named by the writer's pid) and FSDP's staged shards (weights.write_checkpoint)
_LEFTOVER = re.compile(r"\.(step-[0-9]{8,}|best|model)\.(?:(tmp|old)([0-9]+)|shards)")


def sweep_leftovers(out_dir: str | os.PathLike) -> None:
    """Remove the folders an earlier process of this run left half-written or half-deleted when it was killed: a
    later process would not reuse them. Called by the run folder's one writer, under its lock, before any checkpoint
    of the run is written (so before the ranks stage shards); a folder named by a process that still runs (another
    command writing there, `consolidate --out` into the run folder) is left alone."""
    for folder in (Path(out_dir), Path(out_dir) / CHECKPOINTS):
        for entry in folder.iterdir() if folder.is_dir() else ():
            m = _LEFTOVER.fullmatch(entry.name)
            if m and entry.is_dir() and not entry.is_symlink() and not (m[3] and _running(int(m[3]))):
                shutil.rmtree(entry, ignore_errors=True)


def _running(pid: int) -> bool:
    """Whether a process of that pid runs on this machine (this one's own leftovers are not)."""
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


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
        raise MissingFile(f"checkpoint {folder} has no {TRAINER_STATE}")
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
        raise UserError(
            f"{out_dir} already holds a run ({latest or out_dir / METRICS}); continue it with --resume "
            "(resume=True in Python), or choose another output directory"
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
