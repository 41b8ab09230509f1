"""A model folder from an FSDP checkpoint's shards: `bridgelm consolidate RUN/checkpoints/step-N --out DIR`.

Under `--fsdp` a run's checkpoints before its last hold each rank's shards of model and optimiser (`shards/`) and no
model folder: only a resume at the same world size reads them. Here one process rebuilds the run's model from what
the checkpoint's trainer.json records (the base model, its blocks), reads every rank's shards of the weights into it
(bridgelm.shards: nothing unpickled freely, the optimiser's left unread) and writes a model folder as the run's
last checkpoint holds one: `save_pretrained` weights (in the dtype the run kept them: fp32 master weights, or the
base's bfloat16 with --dtype bfloat16), config, and the base's tokenizer. It runs on the CPU, without a process
group, in the memory of one copy of the model.

    bridgelm consolidate rl_run/checkpoints/step-00000300 --out rl_run_step300
    bridgelm eval --model rl_run_step300 --task math ...

Used by bridgelm.cli.train; tested by tests/test_consolidate.py.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import asdict
from pathlib import Path

from bridgelm.errors import DataWarning, UserError
from bridgelm.runs import RUN_FILE, model_fingerprint
from bridgelm.source import ModelSource
from bridgelm.train.checkpoints import (
    CHECKPOINTS,
    LAYOUTS,
    SHARDS,
    TRAINER_INFO,
    checkpoint_damage,
    list_checkpoints,
    read_info,
    write_dir_atomic,
)


def consolidate(checkpoint: str | os.PathLike, out: str | os.PathLike, model: str | None = None) -> Path:
    """Write the weights of the FSDP checkpoint folder `checkpoint` as a model folder `out` (a folder that does not
    exist yet, or an empty one); `model` names the run's base model where it has moved (None: the one the
    checkpoint records). Returns `out`. Bad input (not a sharded checkpoint, a damaged one, a model the shards do
    not fit) is a UserError in one line, and nothing is written."""
    checkpoint, out = Path(checkpoint), Path(out)
    identity = _sharded_identity(checkpoint)
    _check_out(out)
    out = out.resolve() if out.is_symlink() else out  # a link to an empty folder: the folder is written
    base = model or identity.get("model")
    if not base:
        raise UserError(f"checkpoint {checkpoint} records no base model: expected --model, the run's --model")
    if identity.get("model_digest") is not None:  # the run read a local folder
        if model is None and not Path(base).is_dir():
            raise UserError(f"the run's base model {base} is not there any more (moved or removed): expected --model "
                            "where it is now")
        if identity["model_digest"] != model_fingerprint(base):
            warnings.warn(f"model {base}: its files differ from those the run read (changed since, another model, or "
                          "a copy without its files' times): its tokenizer and config are written with the run's "
                          "weights", DataWarning, stacklevel=2)
    policy, tokenizer = ModelSource(base, dtype=_shards_dtype(checkpoint)).load()
    _with_run_blocks(policy, identity.get("blocks"), checkpoint)
    _read_weights(policy, checkpoint)
    from bridgelm.train.weights import save_model

    return write_dir_atomic(out, lambda tmp: save_model(policy, tokenizer, tmp))


def _sharded_identity(checkpoint: Path) -> dict:
    """The run identity a whole, sharded checkpoint records; one line for anything else."""
    if not checkpoint.is_dir():
        raise UserError(f"checkpoint {checkpoint} is not a folder: expected RUN/checkpoints/step-N of an --fsdp run")
    if not (checkpoint / TRAINER_INFO).is_file():
        raise UserError(f"{checkpoint} {_what_instead(checkpoint)}: expected a checkpoint of an --fsdp run, "
                        "RUN/checkpoints/step-N")
    info = read_info(checkpoint)
    if info.get("layout") != LAYOUTS[True]:
        raise UserError(f"checkpoint {checkpoint} is not sharded ({info.get('layout')} layout): it is a model folder "
                        "already; give it as --model")
    damage = checkpoint_damage(checkpoint)
    if damage is not None:
        raise UserError(f"checkpoint {checkpoint} is damaged ({damage}): expected a whole checkpoint")
    identity = info.get("identity")
    if not isinstance(identity, dict):
        raise UserError(f"checkpoint {checkpoint}: its trainer.json records no run identity: expected one written "
                        "by bridgelm rl")
    return identity


def _what_instead(folder: Path) -> str:
    """What a folder given for a checkpoint holds instead (it has no trainer.json)."""
    if (folder / CHECKPOINTS).is_dir() or (folder / RUN_FILE).is_file():
        steps = list_checkpoints(folder)
        return f"is a run folder (its newest checkpoint: {steps[-1]})" if steps else "is a run folder, no checkpoint"
    if folder.name == CHECKPOINTS:
        steps = list_checkpoints(folder.parent)
        return f"holds the run's checkpoints (the newest: {steps[-1]})" if steps else "holds no checkpoint"
    if (folder / "config.json").is_file():
        return "is a model folder already (give it as --model)"
    return f"holds no {TRAINER_INFO} (a checkpoint cut before its last write, or not one)"


def _check_out(out: Path) -> None:
    from bridgelm.jsonl import check_out

    check_out(out, "dir")
    if out.is_dir() and any(out.iterdir()):
        raise UserError(f"--out {out} already holds files, which this would replace: expected a new folder")


def _with_run_blocks(policy, recorded: dict | None, checkpoint: Path) -> None:
    """Attach the blocks the run trained (fresh: the shards overwrite them) unless the base holds them already."""
    from bridgelm.attach import attach_blocks, block_config
    from bridgelm.blocks import BlockConfig

    have = block_config(policy)
    if have is None and recorded is not None:
        attach_blocks(policy, BlockConfig(**recorded))
    elif (None if have is None else asdict(have)) != recorded:
        raise UserError(f"checkpoint {checkpoint} records blocks {recorded}, and its base model holds {have}: "
                        "expected the run's --model")


def _shards_dtype(checkpoint: Path) -> str:
    """The dtype the run kept its weights in (its --dtype: float32 unless the run loaded the base in bfloat16), read
    from the shards' index: the model folder holds them as they are, as the run's last checkpoint does."""
    import torch

    from bridgelm.shards import read_metadata

    index = read_metadata(checkpoint / SHARDS).state_dict_metadata
    kept = {m.properties.dtype for k, m in index.items() if k.startswith("model.") and hasattr(m, "properties")}
    names = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
    floats = [names[d] for d in kept if d in names]
    return floats[0] if len(floats) == 1 else "float32"


def _read_weights(policy, checkpoint: Path) -> None:
    """The weights of every rank's shards into `policy` (its own tensors filled in place), all of them checked."""
    from bridgelm.shards import load_shards

    state = {"model": policy.state_dict()}
    try:
        with warnings.catch_warnings():  # DCP's note that it loads in one process: as meant
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            load_shards(state, checkpoint / SHARDS)
    except (RuntimeError, ValueError) as err:  # a model of other names or shapes than the run's
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserError(f"checkpoint {checkpoint}: its shards do not fit the model ({first[:200]}): expected the "
                        "run's --model") from None
    policy.load_state_dict(state["model"])
