"""What the demo's training stages share, below every module that runs one (stages, the positive control, the
recipe-matched control): fresh blocks of the demo's size drawn from a seed, and what an RL stage records of its run."""

from __future__ import annotations

from bridgelm.attach import add_seeded_blocks
from bridgelm.rng import derive_seed


def with_blocks(model, kind: str, cfg, placement: str = "ffn", seed: int = 0):
    """Fresh blocks of the demo's size, drawn from `seed` (not from the global generator, whose state depends on
    what this process ran before)."""
    return add_seeded_blocks(
        model,
        kind,
        derive_seed(seed, "demo-blocks", kind, placement),
        num_heads=cfg.blocks.num_heads,
        head_dim=cfg.blocks.head_dim,
        placement=placement,
    )


def rl_numbers(result) -> dict:
    """What the RL stage records of its run (done.json): the final model and the reward of its first and last tenth."""
    rewards = [h.get("reward") for h in result.history if h.get("reward") is not None]
    head = rewards[: max(1, len(rewards) // 10)]
    tail = rewards[-max(1, len(rewards) // 10) :]
    return {
        "final_dir": str(result.final_dir),
        "steps": result.steps,
        "first_reward": sum(head) / max(1, len(head)),
        "last_reward": sum(tail) / max(1, len(tail)),
    }
