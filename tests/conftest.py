"""Tiny random Hugging Face models for the tests; nothing is downloaded."""

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import (  # noqa: E402
    Gemma2Config,
    Gemma2ForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"

_COMMON = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

ARCHS = {
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 16}),
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": None}),
    "gemma2": (Gemma2Config, Gemma2ForCausalLM, {"head_dim": 16}),  # norms before and after attention and MLP
}


def tiny_model(arch: str = "qwen2", seed: int = 0, dtype=torch.float32, **overrides):
    """A random 2-layer model of `arch` in eval mode (dropout off), deterministic for `seed`."""
    config_cls, model_cls, extra = ARCHS[arch]
    torch.manual_seed(seed)
    config = config_cls(**{**_COMMON, **extra, **overrides})
    model = model_cls(config).to(dtype)
    return model.eval()


def tiny_composite(seed: int = 0, vocab_size: int = 97):
    """A random Gemma 3 with its vision tower, as AutoModelForCausalLM builds it (Gemma3ForConditionalGeneration): a
    composite config whose language part is its text config."""
    from transformers import AutoModelForCausalLM, Gemma3Config

    text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, vocab_size=vocab_size, sliding_window=16)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    torch.manual_seed(seed)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)
    return AutoModelForCausalLM.from_config(config).eval()


def randomize_blocks(model, std: float = 0.3, seed: int = 1):
    """Give the added blocks non-zero weights (a fresh block contributes nothing)."""
    import bridgelm

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(bridgelm.added_parameters(model).items()):
            if ".norm." in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(std * torch.randn(p.shape, generator=g))
    return model


@pytest.fixture
def shared_data():
    if not SHARED_DATA.is_dir():
        pytest.skip(f"{SHARED_DATA} is absent: these tests read the real data files beside the repository")
    return SHARED_DATA


def save_tiny_model_dir(path, blocks: str | None = None, alphabet: str = "0123456789+-=() abc\n"):
    """A tiny model + char tokenizer saved with save_pretrained into `path` (a model directory)."""
    import bridgelm
    from bridgelm.tokenizer import char_tokenizer

    tok = char_tokenizer(alphabet)
    model = tiny_model(vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    if blocks == "bridge":
        randomize_blocks(bridgelm.add_bridge(model))
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return model, tok


# Tiny models run fastest on one thread, and tests then do not fight each other for the two cores.
torch.set_num_threads(1)


def interrupt_on_call(monkeypatch, module, name: str, call: int):
    """Make `module.name` raise KeyboardInterrupt on its `call`-th call (a simulated Ctrl-C); returns the original."""
    original = getattr(module, name)
    calls = {"n": 0}

    def interrupted(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == call:
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, interrupted)
    return original


@pytest.fixture
def generate_calls(monkeypatch):
    """Every call of `bridgelm.generate` as (prompts, n, width), the calls still going through."""
    import bridgelm

    calls = []
    real = bridgelm.generate

    def spy(model, tokenizer, prompts, **kwargs):
        calls.append((list(prompts), kwargs["n"], kwargs["width"]))
        return real(model, tokenizer, prompts, **kwargs)

    monkeypatch.setattr(bridgelm, "generate", spy)
    return calls
