"""The skeleton every training run shares: start or resume, metrics log, progress bar, Ctrl-C, save and prune.

A trainer (SFT, RL, the demo's pre-training) keeps its own step and writes its loop top to bottom around a `Run`:

    run = Run(out_dir, "sft", identity, cfg.run, dist)   # refuses a used folder unless resuming
    if run.resume_from is not None:
        ...load the checkpoint's weights into the model...
    ...build the optimiser and the schedule...
    run.track(model, optimizer, scheduler, write_weights)  # what a checkpoint holds; restored now when resuming
    with run.running(total, "SFT"):                         # metrics.jsonl, run.json, progress; saves at the end
        for step in range(run.step, total):
            ...work that changes no state (sampling, forward/backward)...   # Ctrl-C here saves the last step
            with run.update():                  # Ctrl-C waits for the end of the update; a second one stops unsaved
                ...optimizer_step(...)...
                run.state["step"] = step + 1
                run.log(record)
            run.save_if_due()

Design notes:
- Outputs in OUT: run.json ({"kind", "identity"}), metrics.jsonl (one record per step) and checkpoints/step-N/
  (bridgelm.runs). `identity` holds the settings that decide the trained weights; a resume must match it. A nested
  config's settings are recorded by dotted name ("rollout.temperature"), so that a refused resume names the one
  that differs.
- One writer: rank 0 holds the run folder's lock (bridgelm.jsonl.exclusive) while the run goes, so a second process
  training into the same folder is refused at once (already when its Run is made), instead of both writing it.
- A step's update is atomic for Ctrl-C and SIGTERM alike (bridgelm.stop): the first signal lets it finish and then
  saves a checkpoint of it; a second stops at once, and nothing is saved (the weights may be half updated); a signal
  outside an update saves the last finished step. With several ranks both are a flag that all ranks read once a step
  (train.agree): all save the same step and stop, and all resume from rank 0's newest checkpoint. A resumed run
  restores optimiser, schedule, global RNG, step and the trainer's extras (`run.state`), drops metrics records after
  the checkpoint, and continues bit for bit.

Used by bridgelm.train.sft, bridgelm.train.rl and bridgelm.demo.base; tested through their tests
(tests/test_sft.py, tests/test_rl.py, tests/test_train_distributed.py) and tests/test_train_common.py.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bridgelm.dist import Dist, load_optimizer_shards
from bridgelm.errors import UserError, check_int
from bridgelm.jsonl import append_record, check_free, exclusive, read_records, write_atomic, write_json
from bridgelm.rng import set_rng_state
from bridgelm.runs import METRICS, RUN_FILE, check_format, check_settings, format_of, jsonable, refuse_run_folder
from bridgelm.setting import setting
from bridgelm.progress import bar as progress_bar
from bridgelm.stop import DeferInterrupt
from bridgelm.train.agree import StoppedTogether, StopSignals, agreed_resume_point
from bridgelm.train.checkpoints import (
    CHECKPOINTS,
    LAYOUTS,
    SHARDS,
    TRAINER_INFO,
    check_layout,
    checkpoint_name,
    latest_checkpoint,
    load_trainer_state,
    prune_checkpoints,
    read_info,
    save_trainer_state,
    sweep_leftovers,
)
from bridgelm.train.optim import Diverged
from bridgelm.train.weights import write_checkpoint


@dataclass
class RunControl:
    """How a run is driven (a trainer config's `run`). None of it changes the trained weights, so a resumed run may
    change any of it."""

    save_every: int = setting(0, "steps between checkpoints (0: only at the end and on Ctrl-C)")
    keep_last: int = setting(2, "checkpoints kept (0: all)")
    resume: bool = setting(False, "continue the run found in the output directory")
    progress: bool = setting(True, "show a progress bar")
    tensorboard: bool = setting(False, "also log to OUT/tensorboard (when tensorboard is installed)")

    def validate(self) -> None:
        check_int("save_every", self.save_every, low=0)  # (what 0 means is each trainer's: see its --help)
        check_int("keep_last", self.keep_last, low=0, note=" (0: all)")


# The field of a trainer config (SFTConfig, RLConfig) that holds its RunControl.
RUN_FIELD = "run"


def settings_of(cfg, free: tuple[str, ...] = ()) -> dict[str, Any]:
    """The fields of a trainer config that decide the trained weights (not its RunControl, not `free`), as JSON has
    them, those of a nested config by dotted name (`free` may name them so: "validation.limit")."""
    settings = {k: v for k, v in asdict(cfg).items() if k != RUN_FIELD}
    return jsonable({k: v for k, v in dotted(settings).items() if k not in free})


def dotted(settings: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A dict of settings whose nested dicts are spread out by dotted key: {"rollout": {"n": 8}} -> {"rollout.n": 8}."""
    out: dict[str, Any] = {}
    for key, value in settings.items():
        if isinstance(value, dict):
            out.update(dotted(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def _refuse_other_run(out_dir: Path, kind: str) -> None:
    """Refuse, resumed or not, a folder whose run.json records another kind of run (an eval run, an SFT run for RL):
    this run would write its own run.json over it."""
    run = refuse_run_folder(out_dir, kind, resumable=True)
    if run is not None:
        check_format(out_dir, run, kind, expected=f"a folder of bridgelm {kind}")  # an older version of this kind


class Run:
    """One training run folder: where it starts, its metrics log and progress bar, Ctrl-C, and its checkpoints."""

    def __init__(
        self, out_dir: str | os.PathLike, kind: str, identity: dict, control: RunControl, dist: Dist, **state: Any
    ):
        """Refuse a used folder unless `control.resume`; when resuming, the newest whole checkpoint
        (`resume_from`) must have been written with `identity`. `state`: the trainer's extras (plain values, saved
        with every checkpoint) and their starting values."""
        self.out_dir = Path(out_dir)
        self.kind = kind  # "sft", "rl", "pretrain": run.json's kind and the name in messages
        self.identity = identity
        self.control = control
        self.dist = dist
        _refuse_other_run(self.out_dir, kind)
        if dist.is_main:  # a second process on this folder is refused now, before the model is placed
            check_free(self.out_dir, folder=True)
        self.resume_from = agreed_resume_point(self.out_dir, control.resume, dist)  # rank 0's, on every rank
        if self.resume_from is None and control.resume and (self.out_dir / METRICS).exists():
            self.say(f"{self.name}: {self.out_dir} holds no checkpoint yet (its run stopped before the first): "
                     "starting afresh, with this command's settings")
        if self.resume_from is not None:
            saved = read_info(self.resume_from).get("identity", {})
            fix = "use another --out, or the settings of that run"
            longer = kind == "rl" and saved.get("steps") != identity.get("steps")
            if longer and (self.resume_from / "config.json").is_file():  # a model folder (under FSDP: the last one)
                fix += (f"; to train on past it, a new run (another --out) from its model, blocks included: --model "
                        f"{self.resume_from} (the optimiser and the schedule start afresh)")
            check_settings(self.resume_from, saved, identity, fix=fix)
        self.state: dict[str, Any] = {"step": 0, **state}  # steps done, and the trainer's extras
        self.saved_at = 0  # step of the last checkpoint
        self.in_update = False  # inside `update()`: a KeyboardInterrupt there leaves nothing to save
        self.signals = StopSignals(dist)  # several ranks: Ctrl-C / SIGTERM as a flag read at `save_if_due`
        self.metrics: MetricsLog | None = None
        self.bar = None
        self._tracked: tuple | None = None
        self.total = 0  # steps of the whole run (`running`): its last checkpoint holds the gathered model
        self.left_behind: Callable[[], str] | None = None  # what else an interrupted run leaves (said after the rest)

    def _writer(self) -> contextlib.AbstractContextManager:
        """The lock of the run folder (rank 0 writes everything in it): a second process that trains into it is
        refused at once (`jsonl.exclusive`); the other ranks hold nothing."""
        return exclusive(self.out_dir, folder=True) if self.dist.is_main else contextlib.nullcontext()

    @property
    def step(self) -> int:
        """Optimiser steps done (the step a resumed run starts from)."""
        return self.state["step"]

    @property
    def name(self) -> str:
        """How the run's messages name it."""
        return "bridgelm demo: pre-training" if self.kind == "pretrain" else f"bridgelm {self.kind}"

    def say(self, text: str) -> None:
        """Print on the main process only."""
        if self.dist.is_main:
            print(text)

    def track(self, model, optimizer, scheduler, write_weights: Callable[[Path, dict | None], None]) -> None:
        """What a checkpoint saves: `write_weights(folder, state_dict)` (state_dict: the gathered FSDP weights, else
        None; under FSDP only the last checkpoint's) plus the optimiser, the schedule, the RNG and `state`. When
        resuming they are restored now; the trainer has loaded the checkpoint's weights itself
        (`weights.load_checkpoint`)."""
        self._tracked = (model, optimizer, scheduler, write_weights)
        if self.resume_from is None:
            return
        check_layout(self.resume_from, self.dist.fsdp)
        saved = load_trainer_state(self.resume_from)
        if self.dist.fsdp:  # each rank reads its own shards
            load_optimizer_shards(model, optimizer, self.resume_from / SHARDS)
        else:
            optimizer.load_state_dict(saved["optimizer"])
        scheduler.load_state_dict(saved["scheduler"])
        set_rng_state(saved["rng"])
        self.state.update(saved["extra"], step=saved["step"])
        self.saved_at = self.step
        self.say(f"bridgelm {self.kind}: resuming at step {self.step} from {self.resume_from}")

    @contextmanager
    def running(self, total: int, desc: str) -> Iterator[Run]:
        """Open metrics.jsonl (records after the resumed step dropped), write run.json and show a progress bar of
        `total` steps. On the way out: a checkpoint of the last step when it has none; on Ctrl-C, one of the last
        finished step (unless stopped inside an update); then KeyboardInterrupt goes on up. The run folder is locked
        meanwhile (one writer)."""
        with self._writer(), self.signals:
            yield from self._running(total, desc)

    def _running(self, total: int, desc: str) -> Iterator[Run]:
        self.total = total
        if self.dist.is_main:  # first: a folder with a run's files but no run.json is refused as not a run's
            write_json(self.out_dir / RUN_FILE, {**format_of(self.kind), "identity": self.identity})
            sweep_leftovers(self.out_dir)
        self.metrics = MetricsLog(
            self.out_dir / METRICS, enabled=self.dist.is_main, tensorboard=self.control.tensorboard
        )
        self.metrics.keep_until(self.step)
        self.bar = progress_bar(
            total, f"{desc} -> {self.out_dir}", "step", self.control.progress and self.dist.is_main, initial=self.step
        )
        try:
            yield self
            if self.saved_at != self.step or latest_checkpoint(self.out_dir) is None:
                self.save()
        except KeyboardInterrupt as err:
            err.said = True  # what was saved is said below: the command line adds no second line
            if self.in_update or (self.dist.world > 1 and not isinstance(err, StoppedTogether)):  # ranks apart
                where = "inside step {}'s update" if self.in_update else "at once in step {}"
                self.say(f"\n{self.name}: stopped {where.format(self.step + 1)}; not saved (last: {self.saved_at})")
            else:
                if self.step != self.saved_at:
                    self.save()
                note = f"; {self.left_behind()}" if self.left_behind is not None else ""
                # A run that resumes by itself (the demo's stages, a command given --resume) continues when run again.
                again = "running the same command again" if self.control.resume else "the same command with --resume"
                self.say(
                    f"\n{self.name}: interrupted; checkpoint of step {self.step} in {self.out_dir / CHECKPOINTS} "
                    f"({again} continues from it){note}"
                )
            raise
        except Diverged as err:  # nothing of the step written: no record, no checkpoint
            raise UserError(err.explain(self.kind, self.step + 1, latest_checkpoint(self.out_dir))) from None
        finally:
            self.bar.close()
            self.metrics.close()

    @contextmanager
    def update(self) -> Iterator[None]:
        """The part of a step that changes what a checkpoint holds: Ctrl-C is held back until it ends."""
        with DeferInterrupt() if self.dist.world == 1 else contextlib.nullcontext():  # several: self.signals
            self.in_update = True
            yield
            self.in_update = False

    def log(self, record: dict, **postfix: Any) -> None:
        """Append the step's record to metrics.jsonl and move the progress bar (showing `postfix`, see
        `progress_fields`). A non-finite loss or gradient norm stops the run (`Diverged`) before it is written."""
        for key in ("loss", "grad_norm"):
            value = record.get(key)
            if isinstance(value, float) and not math.isfinite(value):
                raise Diverged(f"its {key} is {value}", step=record.get("step"))
        self.metrics.log(record)
        self.bar.update(1)
        self.bar.set_postfix(**progress_fields(**postfix))

    @property
    def history(self) -> list[dict]:
        """The metrics records so far, one per step (on every process)."""
        return self.metrics.records

    def save_if_due(self, now: bool = False) -> None:
        """A checkpoint when `now`, every `save_every` steps, or when any rank was signalled (then every rank stops
        here, having saved the same step: StoppedTogether). Every rank calls it once a step, after the update."""
        every = self.control.save_every
        stop = self.signals.agreed()
        if now or stop or (every and self.step % every == 0):
            self.save()
        if stop and self.step < self.total:
            raise StoppedTogether

    def save(self) -> None:
        """A resumable checkpoint OUT/checkpoints/step-N (all ranks call; rank 0 writes, and under FSDP each rank its
        own shards); keeps the last N. Under FSDP only the last step's holds the gathered model as well."""
        model, optimizer, scheduler, write_weights = self._tracked
        step, sharded = self.step, self.dist.fsdp
        extra = {k: v for k, v in self.state.items() if k != "step"}
        whole = not sharded or step == self.total  # a model folder: every checkpoint, under FSDP the last
        info = {**extra, "step": step, "identity": self.identity, **format_of("checkpoint"), "layout": LAYOUTS[sharded]}

        def write(folder: Path, state_dict: dict | None) -> None:
            if whole:
                write_weights(folder, state_dict)
            save_trainer_state(folder, step, None if sharded else optimizer.state_dict(), scheduler, extra)
            write_json(folder / TRAINER_INFO, info)  # last: whole

        final = self.out_dir / CHECKPOINTS / checkpoint_name(step)
        write_checkpoint(final, model, optimizer, self.dist, write, gather=whole)
        if self.dist.is_main:
            prune_checkpoints(self.out_dir, self.control.keep_last)
        self.saved_at = step


# ---------------------------------------------------------------------------------------------- metrics, progress


class MetricsLog:
    """metrics.jsonl (one record per step, appended and fsynced) plus TensorBoard when asked and installed.

    Only the main process writes; every process keeps `records`, the history returned to callers.
    """

    def __init__(self, path: str | os.PathLike, enabled: bool = True, tensorboard: bool = False):
        self.path = Path(path)
        self.enabled = enabled
        self.records: list[dict] = read_records(self.path) if self.path.exists() else []
        self.writer = None
        if tensorboard and enabled:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.writer = SummaryWriter(str(self.path.parent / "tensorboard"))
            except ImportError:
                print("tensorboard is not installed: metrics go to metrics.jsonl only", file=sys.stderr)

    def keep_until(self, step: int) -> None:
        """Drop records after `step` (a resumed run recomputes them identically)."""
        kept = [r for r in self.records if r.get("step", 0) <= step]
        if len(kept) != len(self.records) and self.enabled:
            write_atomic(self.path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in kept))
        self.records = kept

    def log(self, record: dict) -> None:
        self.records.append(record)
        if not self.enabled:
            return
        append_record(self.path, record)
        if self.writer is not None:
            for k, v in record.items():
                if isinstance(v, (int, float)) and k != "step":
                    self.writer.add_scalar(k, v, record.get("step", 0))
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def progress_fields(**fields: Any) -> dict[str, str]:
    """The fields a progress bar shows: those with no value yet (None or "") left out, floats to 4 digits."""
    return {k: f"{v:.4g}" if isinstance(v, float) else str(v) for k, v in fields.items() if v is not None and v != ""}


__all__ = [
    "RUN_FIELD",
    "MetricsLog",
    "Run",
    "RunControl",
    "dotted",
    "progress_fields",
    "settings_of",
]
