"""The demo's arms, one registry: what each RL arm trains, from what, and with which GRPO settings.

An arm is named on the command line (`bridgelm demo --arms bridge,pmatch,...`; RLVR only, P-Match and Bridge always
run) and everything else follows from its entry here: its block kind and placement, the SFT block set it starts from
(None: fresh blocks, or none for RLVR), Bridge groups per prompt, the GRPO settings it changes (`rl`), and whether its
learning rates are chosen on validation problems (`search`, demo/lr_search.py). Every Bridge arm's recipe also runs
on the positive control's task (demo/recipe_control.py), so that the report can say, arm by arm, whether the recipe
can learn a sibling channel at all before it says whether Bridge uses one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from bridgelm.errors import UserError

PAPER_ARMS = ("rlvr", "pmatch", "bridge")  # the paper's Table 1 arms: always run
BASE = "base"  # the base model, evaluated once (seed 0): not an RL arm


@dataclass(frozen=True)
class Arm:
    """One RL arm of the demo."""

    title: str  # its name in the report
    blocks: str | None = None  # the added blocks' kind: "bridge", "pmatch", None (RLVR only: none)
    sft: str | None = None  # the SFT block set it starts from ("bridge", "pmatch", "bridge_attn"); None: fresh or none
    placement: str = "ffn"  # where its blocks sit (paper App. D: "attn")
    groups: int = 1  # Bridge groups per prompt in RL (App. C: 2)
    equal: str = "rollouts"  # with groups > 1, what stays as the Bridge arm's: "rollouts" per step (half the
    # prompts) or "prompts" per step (twice the rollouts)
    rl: dict = field(default_factory=dict)  # RLConfig fields it sets (freeze_base, reward, sibling_weight, advantage)
    search: str | None = None  # learning rates chosen on validation: "block_lr" (DemoConfig.blocks_lrs, base frozen)
    # or "lrs" (DemoConfig.lr_grid: base and block lr); None: the demo's rl.optim.lr

    @property
    def bridge(self) -> bool:
        """Samples in Bridge groups: evaluated at every width, with the controls."""
        return self.blocks == "bridge"


ARMS: dict[str, Arm] = {
    "rlvr": Arm("RLVR only"),
    "pmatch": Arm("P-Match", "pmatch", "pmatch"),
    "bridge": Arm("Bridge", "bridge", "bridge"),
    "bridge_cold": Arm("Bridge, cold start", "bridge"),  # paper Table 4: fresh blocks, no SFT
    "bridge_attn": Arm("Bridge after attention", "bridge", "bridge_attn", placement="attn"),  # paper App. D
    "bridge_blocks": Arm("Bridge, blocks only", "bridge", "bridge", rl={"freeze_base": True}, search="block_lr"),
    # App. C at the Bridge arm's rollouts per step: prompt-wide advantages over 2 groups (the first reading)
    "bridge_2groups": Arm("Bridge, 2 groups per prompt", "bridge", "bridge", groups=2),
    "bridge_majority": Arm("Bridge, group-majority reward", "bridge", "bridge", groups=2, rl={"reward": "majority"}),
    # one reading of App. C: advantages between a prompt's groups, at the Bridge arm's prompts per step
    "bridge_appc": Arm(
        "Bridge, App. C (between groups)", "bridge", "bridge", groups=2, equal="prompts",
        rl={"advantage": "between-groups"},
    ),
    # sibling credit: each rollout paid its group's total (L = w - 1: the exact gradient of a group's summed reward)
    "bridge_sibling": Arm(
        "Bridge, sibling credit", "bridge", "bridge", groups=2, equal="prompts",
        rl={"reward": "sibling", "advantage": "between-groups"},
    ),
    # RLVR at App. C's rollouts per step (2 x 8 independent rollouts per prompt, Bridge's prompts per step): what
    # App. C's extra rollouts alone give
    "rlvr_2x": Arm("RLVR only, 16 rollouts per prompt", groups=2, equal="prompts"),
    "bridge_tuned": Arm("Bridge, lrs chosen on validation", "bridge", "bridge", search="lrs"),
    "pmatch_tuned": Arm("P-Match, lrs chosen on validation", "pmatch", "pmatch", search="lrs"),
}
TITLES = {BASE: "Base", **{name: arm.title for name, arm in ARMS.items()}}
OPTIONAL_ARMS = tuple(name for name in ARMS if name not in PAPER_ARMS)  # what `--arms` may add
ORDER = (BASE, *ARMS)  # rows of the report's tables


def check_arms(names: list[str]) -> None:
    """A ValueError naming an unknown or repeated arm."""
    for name in names:
        if name not in ARMS:
            raise UserError(f"--arms: unknown arm {name!r}: expected some of {', '.join(ARMS)}")
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise UserError(f"--arms names {dup[0]!r} more than once")


def rl_arms(asked: list[str]) -> tuple[str, ...]:
    """The RL arms of a run: the paper's three, then the others asked for, in the registry's order."""
    return PAPER_ARMS + tuple(name for name in ARMS if name in asked and name not in PAPER_ARMS)


def sft_kinds(arms: tuple[str, ...]) -> tuple[str, ...]:
    """The SFT block sets the arms start from, in the registry's order."""
    return tuple(dict.fromkeys(ARMS[a].sft for a in arms if ARMS[a].sft is not None))
