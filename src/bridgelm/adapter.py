"""Blocks as an adapter: `save_blocks` / `load_blocks` on a block file, an adapter folder or a hub id.

A path whose name ends in ".safetensors" is a block file (blockfile.py, unchanged). Anything else is an adapter
folder: `blocks.safetensors` (the same block file) and `bridge_config.json`, which names the base model (its
`config._name_or_path`: the hub id or folder it was loaded from), a digest of the base's weights, and the block
settings. A name that is neither an existing file nor folder is a hub id, fetched with huggingface_hub's
`snapshot_download`; `save_blocks(..., push_to_hub=True)` uploads the folder with `upload_folder`.

The digest (`blockfile.base_digest`, recorded in the block file too) tells the base the blocks were trained on
apart from another of the same shapes. Loading onto a base of another digest is refused in one line; a base of the
same digest under another name is warned about.
"""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path

from torch import nn

from bridgelm import blockfile
from bridgelm.attach import FORMAT, block_config
from bridgelm.blockfile import base_digest
from bridgelm.errors import UserError
from bridgelm.jsonl import read_json_object, write_json

CONFIG_FILE = "bridge_config.json"
BLOCKS_FILE = "blocks.safetensors"
_FIELDS = ("format", "base_model", "base_model_digest", "kind", "num_heads", "head_dim", "placement", "model_type")
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")


# Suffixes of a weight file that a folder's name would not have: a typo for .safetensors, refused by save_blocks
WEIGHT_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".safetensor", ".st", ".gguf", ".npz", ".pkl")


def _is_file_form(path: Path) -> bool:
    return path.suffix == ".safetensors" and not path.is_dir()


def save_blocks(
    model: nn.Module, path: str | os.PathLike, *, push_to_hub: bool = False, repo_id: str | None = None,
    token: str | None = None, private: bool | None = None, commit_message: str = "Bridge blocks",
) -> Path:  # fmt: skip
    """Write the blocks to a block file (a name ending in .safetensors) or an adapter folder (anything else);
    with push_to_hub, also upload the folder to the hub repo `repo_id` (default: the folder's name)."""
    path = Path(path)
    if path.suffix.lower() in WEIGHT_SUFFIXES and not path.is_dir():
        raise UserError(f"cannot save blocks to {path}: expected a name ending in .safetensors (a block file) or "
                        "an adapter folder (a name without a weight file's suffix)")
    if _is_file_form(path):
        if push_to_hub:
            raise UserError(f"push_to_hub with {path}: expected an adapter folder (a path not ending in .safetensors)")
        return blockfile.save_blocks(model, path)
    if path.exists() and not path.is_dir():
        raise UserError(f"cannot save an adapter folder at {path}: a file is in its place; expected a folder")
    blockfile.save_blocks(model, path / BLOCKS_FILE)  # weights first (a model without blocks is refused there): the
    cfg = block_config(model)  # config, written last, completes the folder
    _, meta = blockfile.read_block_settings(path / BLOCKS_FILE)
    record = {k: meta[k] for k in _FIELDS if k in meta}
    record.update(num_heads=cfg.num_heads, head_dim=cfg.head_dim)
    record.update(hidden_size=int(meta["hidden_size"]), num_layers=int(meta["num_layers"]), weights=BLOCKS_FILE)
    write_json(path / CONFIG_FILE, record)
    if push_to_hub:
        _push(path, repo_id or path.resolve().name, token, private, commit_message)
    return path


def _push(path: Path, repo_id: str, token: str | None, private: bool | None, message: str) -> None:
    import huggingface_hub

    huggingface_hub.create_repo(repo_id, token=token, private=private, exist_ok=True)
    huggingface_hub.upload_folder(
        repo_id=repo_id, folder_path=str(path), allow_patterns=[CONFIG_FILE, BLOCKS_FILE], commit_message=message,
        token=token,
    )  # fmt: skip


def load_blocks(
    model: nn.Module, path: str | os.PathLike, *, revision: str | None = None, token: str | None = None
) -> nn.Module:
    """Load blocks from a block file, an adapter folder or a hub id into `model` (see the module's docstring)."""
    p = Path(path).expanduser()
    if p.is_dir():
        return _load_folder(model, p)
    if p.exists() or p.suffix == ".safetensors" or not _HUB_ID.fullmatch(str(path)):
        return blockfile.load_blocks(model, path)
    return _load_folder(model, _download(str(path), revision, token))


def check_local_blocks(path: str | os.PathLike, config) -> None:
    """Before a model of `config` loads: a block file or adapter folder that is missing, not one, or made for
    another architecture is a UserError in one line (`blockfile.check_architecture`). A hub id is checked once
    fetched, by `load_blocks`."""
    p = Path(path).expanduser()
    if p.is_dir():
        read_adapter_config(p)
        if not (p / BLOCKS_FILE).exists():
            return  # load_blocks names what the folder lacks
        p = p / BLOCKS_FILE
    elif not p.exists() and p.suffix != ".safetensors" and _HUB_ID.fullmatch(str(path)):
        return  # a hub id: checked once fetched
    blockfile.check_architecture(p, config)


def _download(repo_id: str, revision: str | None, token: str | None) -> Path:
    import huggingface_hub
    from huggingface_hub import constants, errors

    try:
        folder = huggingface_hub.snapshot_download(
            repo_id, revision=revision, token=token, allow_patterns=[CONFIG_FILE, BLOCKS_FILE]
        )
    except (errors.HfHubHTTPError, errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled, ValueError) as err:
        why = "HF_HUB_OFFLINE=1 and it is not cached" if constants.HF_HUB_OFFLINE else type(err).__name__
        raise UserError(
            f"blocks {repo_id!r}: no such local file or folder, and the hub id could not be fetched ({why}): "
            "expected a block file, an adapter folder or a hub id of one"
        ) from None
    return Path(folder)


def read_adapter_config(folder: Path) -> dict:
    """An adapter folder's bridge_config.json, every field present; anything else one line naming the file."""
    config = folder / CONFIG_FILE
    if not config.is_file():
        model = " It holds a model (config.json): give it as --model, blocks included." if (
            folder / "config.json").is_file() else ""
        raise UserError(
            f"block file {folder} is a folder: expected a .safetensors file of blocks, or an adapter folder with its "
            f"{CONFIG_FILE} (written by save_blocks).{model}"
        )
    record = read_json_object(config, "an adapter config written by save_blocks")
    missing = [k for k in _FIELDS if k not in record]
    if missing:
        raise UserError(f"{config} lacks {', '.join(missing)}: expected an adapter config written by save_blocks")
    if record["format"] != FORMAT:
        raise UserError(f"{config} has format {record['format']!r}: expected {FORMAT!r}")
    return record


def _load_folder(model: nn.Module, folder: Path) -> nn.Module:
    record = read_adapter_config(folder)
    weights = folder / BLOCKS_FILE
    if not weights.exists():
        raise UserError(f"adapter folder {folder} has no {BLOCKS_FILE}: expected the blocks beside {CONFIG_FILE}")
    cfg, meta = blockfile.read_block_settings(weights)
    stated = {k: str(record[k]) for k in ("kind", "num_heads", "head_dim", "placement", "model_type")}
    differ = [k for k, v in stated.items() if meta[k] != v]
    if differ:
        raise UserError(
            f"{folder / CONFIG_FILE} says {differ[0]}={stated[differ[0]]!r} but {BLOCKS_FILE} holds "
            f"{meta[differ[0]]!r}: expected the config and weights save_blocks wrote together"
        )
    _check_base(model, record, folder)
    return blockfile.load_blocks(model, weights)


def _check_base(model: nn.Module, record: dict, folder: Path) -> None:
    digest, name = base_digest(model), blockfile._base_name(model)
    if digest != record["base_model_digest"]:
        raise UserError(
            f"adapter {folder} holds blocks trained on base {record['base_model']!r} (weights digest "
            f"{str(record['base_model_digest'])[:19]}), and this model ({name!r}) has digest {digest[:19]}: "
            "expected the base model the blocks were trained on"
        )
    if name != record["base_model"]:
        warnings.warn(
            f"adapter {folder} names base {record['base_model']!r} and this model is {name!r}; their weights "
            "digests agree, so the blocks are loaded",
            stacklevel=3,
        )
