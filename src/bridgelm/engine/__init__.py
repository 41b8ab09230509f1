"""The sampling engine: N interdependent samples per prompt, in Bridge groups of width w.

Two entry points: `stream_ids` (token ids in and out) and `stream_text` (text in and out), each yielding a prompt's
samples as soon as they are done; `generate_ids` and `generate` collect them in a list. The pieces, from the
bottom: `config` (SamplingConfig), `cache` (the preallocated slab cache), `randomness` (per-sample random streams),
`sampler` (temperature, top-k, exact top-p), `step` (the decode step, eager and compiled), `waves` (batches that
respect the memory bounds), `loop` (prefill once, copy the cache, decode), `text` (tokenizing at the edges). How it
works and how fast: docs/engine.md.
"""

from bridgelm.engine.config import MIN_TEMPERATURE, SamplingConfig, check_sampling
from bridgelm.engine.loop import GeneratedIds, generate_ids, stream_ids
from bridgelm.engine.step import compile_wins
from bridgelm.engine.text import (
    Sample,
    check_prompt_chars,
    check_stop_strings,
    encode_text,
    encode_prompts,
    eos_ids,
    generate,
    pad_id,
    stop_checker,
    stream_text,
)

__all__ = [
    "MIN_TEMPERATURE",
    "SamplingConfig",
    "check_sampling",
    "GeneratedIds",
    "generate_ids",
    "stream_ids",
    "compile_wins",
    "Sample",
    "check_prompt_chars",
    "check_stop_strings",
    "encode_text",
    "encode_prompts",
    "eos_ids",
    "generate",
    "pad_id",
    "stop_checker",
    "stream_text",
]
