"""bridgelm: Bridge (batch reasoning with interdependent generations) for Hugging Face causal LMs.

model = bridgelm.add_bridge(model)                      # zero-initialised: changes nothing yet
logits = bridgelm.grouped_logits(model, ids, mask, group_ids)
"""

from bridgelm.attach import add_bridge, add_pmatch, added_parameters, block_config
from bridgelm.adapter import load_blocks, save_blocks
from bridgelm.blocks import BlockConfig
from bridgelm.grouped import Groups, grouped_logits
from bridgelm.models import load_model

__all__ = [
    "add_bridge",
    "add_pmatch",
    "added_parameters",
    "block_config",
    "load_blocks",
    "load_model",
    "save_blocks",
    "grouped_logits",
    "Groups",
    "BlockConfig",
]

from bridgelm.engine import Sample, SamplingConfig, generate, generate_ids  # noqa: E402

__all__ += ["generate", "generate_ids", "Sample", "SamplingConfig"]
