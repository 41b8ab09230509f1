"""Training: warm-up data, SFT warm-up of the new blocks, and GRPO with interdependent rollouts.

make_warmup_data(model, tokenizer, task, "warmup.jsonl")          # bridgelm warmup-data
train_sft(model, tokenizer, "warmup.jsonl", SFTConfig(), "sft")    # bridgelm sft
train_rl(model, tokenizer, task, RLConfig(), "rl")                 # bridgelm rl
"""

from bridgelm.train.loop import RunControl
from bridgelm.train.optim import OptimConfig
from bridgelm.train.rl import RLResult, train_rl
from bridgelm.train.rl_config import RLConfig
from bridgelm.train.sft import SFTConfig, SFTResult, train_sft
from bridgelm.train.warmup_data import make_warmup_data

__all__ = [
    "OptimConfig",
    "RLConfig",
    "RLResult",
    "RunControl",
    "SFTConfig",
    "SFTResult",
    "make_warmup_data",
    "train_rl",
    "train_sft",
]
