"""The misalignment dose-response of the positive control: does the sibling channel survive when siblings reach the
same step of their reasoning at different positions?

A Bridge block reads a sibling only at the same position, while real chains of thought differ in length by thousands
of tokens. Here each worked solution of the control's task starts with 0..p filler dots (p: the preamble, drawn per
sample; tasks/hint.py `HintSpec.preamble`), so that a group's reads sit at positions up to p apart. For each p of
`DemoConfig.misalignment` the control is run again from a base model pre-trained on such solutions, at the control's
own recipe (which passes at p = 0), and evaluated as it is (w = 1, w = 8, foreign siblings); p = 0 is the control
itself. `results.json` "misalignment": {p: the control's numbers at p}.

Outputs, under DIR/control/misalign_p<p>/: base/, rl_s<seed>/, eval_s<seed>/, foreign_s<seed>/.
"""

from __future__ import annotations

from dataclasses import replace

from bridgelm.demo.control import HINT_TOKENS, ControlConfig, ControlDirs, control_results
from bridgelm.errors import UserError

CONTEXT = 256  # the control model's positions (demo/base.py build_model)
PROMPT_ROOM = 32  # the prompt (8 digits, "?", BOS) and the reads, boxed answer and EOS: 14 + 16 tokens, rounded up
MAX_PREAMBLE = CONTEXT - PROMPT_ROOM


def check_preambles(preambles: list[int]) -> None:
    """A ValueError naming a preamble that is negative or leaves the control model no room for the prompt and reads."""
    for p in preambles:
        if not isinstance(p, int) or p < 0 or p > MAX_PREAMBLE:
            raise UserError(
                f"--misalignment {p}: expected preambles of 0 to {MAX_PREAMBLE} tokens (the control model has "
                f"{CONTEXT} positions, {PROMPT_ROOM} of them for the prompt and the reads)"
            )


def control_at(cfg: ControlConfig, preamble: int) -> ControlConfig:
    """The control with solutions that start with 0..preamble filler dots, and room for them in every sample."""
    tokens = HINT_TOKENS + preamble
    return replace(
        cfg,
        base=replace(cfg.base, task=replace(cfg.base.task, preamble=preamble)),
        rl=replace(cfg.rl, rollout=replace(cfg.rl.rollout, max_new_tokens=tokens)),
        eval=replace(cfg.eval, sampling=replace(cfg.eval.sampling, max_new_tokens=tokens)),
    )


def dirs_at(control: ControlDirs, preamble: int) -> ControlDirs:
    """Preamble 0 is the control itself; the others have folders of their own beside it."""
    return control if preamble == 0 else ControlDirs(control.root / f"misalign_p{preamble}")


def results(demo, control: ControlDirs) -> dict:
    """{str(p): control_results at preamble p} for every preamble whose runs are done."""
    out = {}
    for p in demo.misalignment:
        r = control_results(control_at(demo.control, p), dirs_at(control, p), demo.seeds)
        if r is not None:
            out[str(p)] = r
    return out
