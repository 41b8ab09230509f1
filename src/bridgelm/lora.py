"""LoRA on the base model beside trainable Bridge blocks, through peft (`pip install 'bridgelm[lora]'`).

`add_lora` injects peft's LoRA layers in place (`peft.inject_adapter_in_model`: the model keeps its class and its
interface, so the engine, grouped forwards and the trainers see the same model), on the base's modules named by
`LoraSettings.targets` and never inside a Bridge / P-Match block: a block's `o_proj` is not the attention's. The
blocks stay fully trainable; the base's own weights are frozen; the LoRA weights train.

One unit on disk: `save_folder` writes a normal Bridge model folder (model type "bridgelm") whose base weights have
the LoRA update merged in (W + alpha / r x B A), so `bridgelm.load_model`, AutoModelForCausalLM, eval and generate
load it as any model with blocks, and beside it `lora/`, the adapter in peft's own layout (adapter_config.json,
adapter_model.safetensors: what `PeftModel.from_pretrained` reads onto the unmerged base with the same blocks).
A resumed run reads its LoRA weights back exactly from `lora/` and its blocks from the folder (`load_trained`); the
base's weights come from the run's `--model` (they never change).

Used by bridgelm.train (sft, rl, weights) and bridgelm.integrations.trl; tested by tests/test_lora.py.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from bridgelm.attach import block_config, save_with_own_names
from bridgelm.blockfile import check_fits
from bridgelm.errors import UserError, check_int, check_number
from bridgelm.rng import derive_seed
from bridgelm.setting import setting

ADAPTER_DIR = "lora"  # the adapter's folder inside a saved model folder
ADAPTER = "default"  # peft's adapter name
PEFT_PREFIX = "base_model.model."  # how PeftModel names the weights of the model it wraps (adapter files use it)
DEFAULT_TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
INSTALL = "pip install 'bridgelm[lora]'"


@dataclass
class LoraSettings:
    """LoRA of the base model (None rank: no LoRA)."""

    r: int | None = setting(None, "LoRA rank on the base's projections; the base's own weights then stay frozen "
                                  "and the blocks train beside the LoRA weights (None: no LoRA)")
    alpha: float | None = setting(None, "LoRA alpha: the update is scaled by alpha / r (None: 2 x r)")
    targets: str = setting(DEFAULT_TARGETS, "comma list of the base's module names that get LoRA (never a "
                                            "block's modules)")

    def validate(self) -> None:
        """ValueError (naming lora_r, lora_alpha, lora_targets) for settings that cannot work."""
        if self.r is None:
            for name, value, unset in (("alpha", self.alpha, None), ("targets", self.targets, DEFAULT_TARGETS)):
                if value != unset:  # it would be ignored, silently
                    raise UserError(f"lora_{name}={value!r} is read only with a LoRA rank: expected lora_r=R too, "
                                    f"or no lora_{name}")
            return
        check_int("lora_r", self.r)
        if self.alpha is not None:
            check_number("lora_alpha", self.alpha, 0, open_low=True)
        names = self.target_names()
        bad = next((n for n in names if not re.fullmatch(r"[A-Za-z0-9_]+", n)), None)
        if not names or bad is not None:
            raise UserError(f"lora_targets={self.targets!r}: expected a comma list of module names (q_proj,v_proj)")

    def target_names(self) -> list[str]:
        return [t.strip() for t in self.targets.split(",") if t.strip()]

    @property
    def enabled(self) -> bool:
        return self.r is not None


def require_peft():
    """The peft module, or a one-line UserError saying how to install it."""
    try:
        import peft
    except ImportError as err:
        raise UserError(f"LoRA needs the peft library, which is not installed: {INSTALL}") from err
    return peft


def block_pattern(model: torch.nn.Module) -> str | None:
    """A regex (peft's exclude_modules) that fully matches the names of the modules inside the blocks, or None."""
    cfg = block_config(model)
    return None if cfg is None else rf"(.*\.)?{cfg.kind}(\..*)?"


def check_targets(model: torch.nn.Module, settings: LoraSettings) -> None:
    """UserError naming the first of `settings.targets` that names no module of `model`'s base (outside the blocks)."""
    names = settings.target_names()
    blocks = block_pattern(model)
    found = {key.rsplit(".", 1)[-1] for key, _ in model.named_modules() if not (blocks and re.fullmatch(blocks, key))}
    missing = [n for n in names if n not in found]
    if missing:
        raise UserError(f"lora_targets={settings.targets!r}: {missing[0]!r} names no module of the base model "
                        f"{type(model).__name__} (outside the blocks): expected names such as {DEFAULT_TARGETS}")


def add_lora(model: torch.nn.Module, settings: LoraSettings, seed: int) -> torch.nn.Module:
    """Inject LoRA (`settings`) into `model`'s base modules in place, its weights drawn from `seed` (the global
    generator left as it was): only the LoRA weights and the blocks train from then on (`train_adapters`). A target
    name that matches no base module is refused before anything changes."""
    settings.validate()
    peft = require_peft()
    check_targets(model, settings)
    names, blocks = settings.target_names(), block_pattern(model)
    alpha = settings.alpha if settings.alpha is not None else 2 * settings.r
    targets = rf"(?!{blocks}$)(.*\.)?({'|'.join(map(re.escape, names))})" if blocks else names
    config = peft.LoraConfig(r=settings.r, lora_alpha=alpha, lora_dropout=0.0, target_modules=targets, bias="none")
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        peft.inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    model._bridgelm_lora = config  # what save_folder writes as adapter_config.json
    train_adapters(model)
    return model


def prepare(model: torch.nn.Module, settings: LoraSettings, seed: int, trainer: str) -> torch.nn.Module:
    """`model` with LoRA (`add_lora`, its weights drawn from the run's `seed` and the `trainer`'s name) when `settings`
    ask for it, else as it is: what SFT and RL do before their run's identity is taken (a target that names no
    module is refused before the run folder is touched; RL's checksum holds the seeded LoRA weights)."""
    if settings.enabled:
        add_lora(model, settings, derive_seed(seed, f"{trainer}-lora"))
    return model


def lora_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The model's peft LoRA layers by module name ({} without LoRA; peft is imported only if something did)."""
    if "peft" not in sys.modules:
        return {}
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


def has_lora(model: torch.nn.Module) -> bool:
    return bool(lora_layers(model))


def lora_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The LoRA weights by their names in `model.named_parameters()`."""
    return {n: p for n, p in model.named_parameters() if ".lora_" in n}


def train_adapters(model: torch.nn.Module) -> None:
    """Only the LoRA weights and the blocks' train; the base's own weights are frozen."""
    from bridgelm.attach import added_parameters

    trained = set(lora_parameters(model)) | set(added_parameters(model))
    for name, p in model.named_parameters():
        p.requires_grad_(name in trained)


def disable(model: torch.nn.Module) -> None:
    """Turn the LoRA layers of `model` off (a reference copy: the base without LoRA, its blocks as they are)."""
    for layer in lora_layers(model).values():
        layer.enable_adapters(False)


@torch.no_grad()
def merged_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """`model`'s weights as the model without LoRA names them, each LoRA layer's base weight with its update merged
    (W + scale x B A, in the weight's dtype); the model is left as it is."""
    layers = lora_layers(model)
    out = {}
    for name, t in model.state_dict().items():
        if ".lora_" not in name:
            out[name.replace(".base_layer.", ".")] = t
    for name, layer in layers.items():
        base = layer.get_base_layer().weight
        delta = layer.get_delta_weight(ADAPTER) if ADAPTER in layer.lora_A else torch.zeros_like(base)
        out[f"{name}.weight"] = (base.float() + delta.float()).to(base.dtype)
    return out


def save_adapter(model: torch.nn.Module, folder: Path) -> None:
    """The LoRA weights and config into `folder` in peft's adapter layout."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    weights = {PEFT_PREFIX + n.replace(f".{ADAPTER}.", "."): p.detach().cpu().contiguous()
               for n, p in lora_parameters(model).items()}
    save_file(weights, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = model._bridgelm_lora
    config.base_model_name_or_path = str(getattr(model.config, "_name_or_path", "")) or None
    config.save_pretrained(str(folder))


def save_folder(model: torch.nn.Module, folder: Path) -> None:
    """A model folder with the LoRA merged into the base's weights (a normal Bridge model), and `lora/` beside."""
    save_with_own_names(model, folder, merged_state_dict(model))
    save_adapter(model, folder / ADAPTER_DIR)


@torch.no_grad()
def load_adapter(model: torch.nn.Module, folder: Path) -> None:
    """The LoRA weights of adapter folder `folder` (save_adapter's) into `model`'s LoRA layers, exactly."""
    from safetensors.torch import load_file

    path = folder / "adapter_model.safetensors"
    if not path.is_file():
        raise UserError(f"{folder} holds no adapter_model.safetensors: expected the LoRA weights of a LoRA run")
    saved = load_file(str(path))
    own = lora_parameters(model)
    want = {PEFT_PREFIX + n.replace(f".{ADAPTER}.", "."): n for n in own}
    check_fits(f"{path} (LoRA weights)", {k: tuple(t.shape) for k, t in saved.items()},
               {key: tuple(own[name].shape) for key, name in want.items()},
               ": expected a run with the same --lora-r and --lora-targets")
    for key, name in want.items():
        own[name].copy_(saved[key])


@torch.no_grad()
def load_trained(model: torch.nn.Module, folder: Path) -> None:
    """What a LoRA run trained, from model folder `folder` (save_folder's): the LoRA weights from `lora/`, the blocks
    from the folder's weights; the base's weights stay as they are (frozen, from the run's --model)."""
    from safetensors.torch import load_file

    from bridgelm.attach import added_parameters

    load_adapter(model, folder / ADAPTER_DIR)
    blocks = added_parameters(model)
    loaded = {}
    for f in sorted(folder.glob("*.safetensors")):
        loaded.update({k: v for k, v in load_file(str(f)).items() if k in blocks})
    check_fits(f"{folder} (blocks)", {k: tuple(t.shape) for k, t in loaded.items()},
               {k: tuple(p.shape) for k, p in blocks.items()}, ": expected a checkpoint of this run")
    for name, p in blocks.items():
        p.copy_(loaded[name])
