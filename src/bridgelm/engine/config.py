"""How to sample: `SamplingConfig` (a plain dataclass, one comment per field) and the checks of its numbers."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from bridgelm.errors import UserError, check_int, check_number
from bridgelm.setting import setting

# The smallest temperature above 0. Sampling is greedy in all but name long before it; far below it logits /
# temperature overflow float32 (1e-45 gave inf logits, NaN log-probs and one repeated token).
MIN_TEMPERATURE = 1e-6


def check_sampling(
    temperature: float, top_p: float, names: Mapping[str, str] | None = None, greedy: bool = True, why: str = ""
) -> None:
    """UserError naming `temperature` / `top_p` (as `names` words them: the flags' names) unless temperature is 0
    (when `greedy`) or at least MIN_TEMPERATURE, and top_p is in (0, 1]; NaN and infinities are refused. `why` ends
    the message of a temperature refused where sampling cannot be greedy."""
    names = names or {}
    check_number(names.get("top_p", "top_p"), top_p, 0, 1, open_low=True)
    name = names.get("temperature", "temperature")
    if greedy and temperature == 0 and not isinstance(temperature, bool):
        return
    check_number(name, temperature, 0, open_low=not greedy, note=" (0 = greedy)" if greedy else why)
    if temperature < MIN_TEMPERATURE:
        raise UserError(
            f"{name}={temperature!r}: expected {'0 (greedy) or ' if greedy else ''}at least {MIN_TEMPERATURE} "
            f"(sampling is greedy in all but name before that, and far below it logits / temperature overflow){why}"
        )


@dataclass
class SamplingConfig:
    """How to sample. Temperature and top-p are the paper's evaluation values; n, width and max_new_tokens are small
    (the paper evaluates 32 samples in groups of 8, MATH-500 4 in one group of 4: `bridgelm eval`'s defaults)."""

    n: int = setting(8, "samples per prompt")
    width: int = setting(1, "Bridge group width w (w divides n); 1 = independent samples")
    max_new_tokens: int = setting(256, "generated tokens per sample, at most")
    temperature: float = setting(0.6, "0 = greedy")
    top_p: float = setting(0.95, "nucleus mass in (0, 1]")
    top_k: int = setting(0, "0 = off")
    seed: int = setting(0, "seeds the torch.Generator of the whole run")
    max_batch_sequences: int = setting(256, "rows decoded together, at most")
    max_batch_tokens: int = setting(262_144, "rows x (longest prompt + max_new_tokens) of a wave, at most")
    compact_fraction: float = setting(0.125, "drop finished groups once they are this "
                                             "fraction of the batch (0: each one)")
    refill: bool = setting(False, "a finished group's rows take a waiting prompt's group (bridgelm.engine.refill: "
                                  "faster or slower than waves by workload, docs/engine.md); False: waves")
    foreign_groups: bool = setting(False, "control: group sample j of `width` different prompts (see docs/engine.md)")
    compile: bool | None = setting(None, "torch.compile the decode step; None: where it wins (CUDA), see compile_wins")
    pack_weights: bool = setting(True, "eager CPU decoding packs linear weights "
                                       "for oneDNN once per wave (bridgelm.packed)")
    share_prompts: bool | None = setting(None, "the eager step holds each prompt's keys and values once, not once "
                                               "per sample (bridgelm.prompt_attention); None: where it pays "
                                               "(engine.batch.share_pays); False: a copy per sample; only "
                                               "where the model allows (engine.step.shares_prompts)")

    def validate(self, names: Mapping[str, str] | None = None, greedy: bool = True, why: str = "") -> None:
        """UserError unless these settings can be sampled. `names`: how the messages name a field (its flag's words,
        e.g. {"n": "rollouts"}; else the field's own name); `greedy`, `why`: as check_sampling's."""
        name = {f.name: (names or {}).get(f.name, f.name) for f in fields(self)}
        for field in ("n", "width", "max_new_tokens", "max_batch_sequences", "max_batch_tokens"):
            check_int(name[field], getattr(self, field))
        if self.n % self.width and not self.foreign_groups:
            raise UserError(f"{name['width']}={self.width} must divide {name['n']}={self.n}")
        check_sampling(self.temperature, self.top_p, name, greedy=greedy, why=why)
        check_int(name["top_k"], self.top_k, low=0, note=" (0 = off)")
        check_int(name["seed"], self.seed, low=0)
        check_number(name["compact_fraction"], self.compact_fraction, 0, 1, note=" (0: at every finished group)")
        if self.max_batch_sequences < self.width:
            raise UserError(
                f"{name['max_batch_sequences']}={self.max_batch_sequences} must hold at least one group of "
                f"{name['width']}={self.width} rows"
            )
        if self.foreign_groups and self.max_batch_sequences < self.width * self.n:
            raise UserError(
                f"foreign_groups: {name['max_batch_sequences']}={self.max_batch_sequences} must hold width x n = "
                f"{self.width * self.n} rows (the samples of `width` prompts decoded together)"
            )


def with_settings(cfg: SamplingConfig | None, changes: dict[str, Any]) -> SamplingConfig:
    """`cfg` (None: `SamplingConfig()`) with `changes` of its fields; a name that is no field is refused in one line."""
    if cfg is not None and not isinstance(cfg, SamplingConfig):
        raise UserError(f"cfg={cfg!r}: expected a SamplingConfig, or the settings as keywords (n=8, width=4)")
    names = [f.name for f in fields(SamplingConfig)]
    unknown = [k for k in changes if k not in names]
    if unknown:
        raise UserError(f"{unknown[0]}={changes[unknown[0]]!r}: not a sampling setting (expected one of "
                        f"{', '.join(names)})")
    return replace(cfg if cfg is not None else SamplingConfig(), **changes)
