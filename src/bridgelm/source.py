"""Where a run's inputs come from, and loading them: the model (`ModelSource`: a folder or hub id, a block file, a
dtype, a device, torch's threads) and the task (`TaskSource`: a name, a data file, a split).

The entry points of the commands (bridgelm.launch, bridgelm.eval.launch, bridgelm.samples) take these, so a Python
user loads a model as `bridgelm rl --model M --blocks B --device cuda` does:

    model, tokenizer = ModelSource("M", blocks="B", device="cuda").load()
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

from bridgelm.errors import DataWarning, UserError


def refuse_split_of_file(split: str, default: str, data: str | None, flags=("--split", "--data")) -> None:
    """UserError when a split other than `default` is given beside a data file: a file is read whole, and the split
    would be recorded, never read (`flags`: the words that name the two)."""
    if data is not None and split != default and Path(data).expanduser().is_file():
        raise UserError(f"{flags[0]} {split} is read from a data folder (FOLDER/{split}.jsonl) or the hub's copy, and "
                        f"{flags[1]} {data} is a file, read as it is: expected a data folder, or no {flags[0]}")


@dataclass(frozen=True)
class TaskSource:
    """A task by name (gsm8k, math, ...) with examples from `data` (None: the task's own source) of `split`."""

    name: str
    data: str | None = None
    split: str = "train"

    def load(self):
        from bridgelm import tasks

        return tasks.load(self.name, self.data, split=self.split)


@dataclass(frozen=True)
class ModelSource:
    """The model of a run: `model` (a folder or hub id) with the blocks of `blocks` (a block file, an adapter folder
    or its hub id; None: as the model holds them), in `dtype` on `device` (under torchrun, cuda is the rank's own
    GPU), with `threads` torch threads (0: hardware.default_threads)."""

    model: str
    blocks: str | None = None
    dtype: str = "float32"
    device: str = "cpu"
    threads: int = 0

    def load(self):
        """(model, tokenizer), their vocabularies checked against each other."""
        from bridgelm.tokenizer import check_vocab

        model, tokenizer = self.load_model(), self.load_tokenizer()
        check_vocab(model, tokenizer, self.model)
        return model, tokenizer

    def load_model(self, blocks: str | None | bool = True):
        """The model with `blocks` (True: this source's; None: none), in the dtype, on this rank's device
        (`dist.rank_device`: under torchrun cuda is the rank's own GPU, cuda:LOCAL_RANK, from the first tensor); a
        bfloat16 that this CPU runs slowly is warned first."""
        from bridgelm.dist import rank_device
        from bridgelm.models import load_model

        if str(self.device).split(":")[0] == "meta":  # load_model takes it (shapes only); a run computes
            raise UserError(
                f"--device {self.device}: the meta device holds no values to compute with; expected cpu or cuda"
            )
        warn_slow_bf16(self.dtype == "bfloat16", self.device)
        set_threads(self.threads)
        device = rank_device(self.device)
        warn_idle_gpus(device)
        blocks = self.blocks if blocks is True else blocks
        return load_model(self.model, blocks=blocks, dtype=dtype_of(self.dtype), device=device)

    def load_tokenizer(self):
        """The tokenizer of the model; one that cannot be loaded (missing, damaged files) is a UserError."""
        from bridgelm.tokenizer import load_tokenizer

        try:
            return load_tokenizer(self.model)
        except UserError:
            raise
        except Exception as err:  # transformers and tokenizers raise many types for missing or damaged files
            first = str(err).splitlines()[0] if str(err) else ""
            raise UserError(
                f"--model {self.model}: no tokenizer could be loaded from it ({type(err).__name__}: {first})"
            ) from err


def dtype_of(name: str):
    from bridgelm.models import DTYPES

    return DTYPES[name]


def width_is_moot(model) -> str | None:
    """Why the generation width cannot change `model`'s samples (None: it has Bridge blocks, so it can)."""
    from bridgelm.attach import block_config

    kind = getattr(block_config(model), "kind", None)
    if kind == "bridge":
        return None
    return "its P-Match blocks read one sample each" if kind else "it has no Bridge blocks"


def warn_slow_bf16(asked: bool, device, flag: str = "--dtype bfloat16") -> None:
    """A DataWarning when `flag` asks for bf16 (`asked`) on a CPU whose oneDNN has no bf16 (AVX2 only, no AVX-512),
    where it runs some 100x slower than float32 (measured on an AMD EPYC: 0.9-2.9 against 53-176 GFLOP/s)."""
    import torch

    from bridgelm import packed

    if asked and torch.device(device).type == "cpu" and not packed.half_instructions(torch.bfloat16):
        warnings.warn(
            f"{flag} on this CPU, which has no bf16 matmul instructions (AVX2 only): it runs far slower than float32 "
            "here (about 100x)",
            DataWarning,
            stacklevel=2,
        )


def warn_idle_gpus(device: str) -> None:
    """A DataWarning when a command computes on the CPU (`--device`'s default) of a machine with CUDA GPUs."""
    import torch

    if str(device).split(":")[0] == "cpu" and torch.cuda.is_available():  # a device name checked later, where used
        warnings.warn(f"computing on the CPU while this machine has {torch.cuda.device_count()} CUDA GPU(s): "
                      "--device cuda computes there", DataWarning, stacklevel=2)


def set_threads(threads: int) -> None:
    """torch's threads for a command: `threads`, or 0 for `hardware.default_threads` (no oversubscription of a
    loaded machine: there a step took 10x longer with 2 threads on 2 busy cores than with 1)."""
    import torch

    from bridgelm.hardware import default_threads

    threads = threads or default_threads()[0]
    if threads != torch.get_num_threads():
        torch.set_num_threads(threads)
