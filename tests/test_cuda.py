"""The engine and the trainers on a CUDA GPU, against slow references computed on the CPU.

Skipped with the reason on a machine without CUDA (CI has none; run these where a GPU is at hand). What they check:
- the engine's sampled log-probs on the GPU equal `grouped_logits` of the same weights on the CPU, with the eager
  decode step and with the compiled one (CUDA graphs, static cache, batch buckets, the draws inside the graph),
  and both draw the same tokens; the eager step's decode attention takes the matmul path, and the compiled step
  draws inside its graph;
- greedy decoding equals transformers' `generate` on the GPU; bf16 log-probs follow the teacher-forced forward;
- one GRPO mini-batch gives the CPU's loss and gradients; an SFT and an RL run train on the GPU end to end.
"""

import copy
from dataclasses import replace

import pytest
import torch
from conftest import randomize_blocks, tiny_model
from test_engine import EOS, teacher_forced_logprobs

import bridgelm
from bridgelm.engine import SamplingConfig, generate_ids

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine")

CUDA = torch.device("cuda")


def bridged(arch="qwen2", dtype=torch.float32, seed=0):
    return randomize_blocks(bridgelm.add_bridge(tiny_model(arch, seed=seed, dtype=dtype)), std=0.2)


@pytest.fixture(autouse=True)
def exact_fp32_matmuls():
    """TF32 off (PyTorch's default for matmuls, made explicit): fp32 results comparable with the CPU's."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


@pytest.mark.parametrize(
    "compile,share", [(False, None), (False, True), (True, None)], ids=["eager", "shared-prompt", "compiled"]
)
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_gpu_logprobs_equal_cpu_grouped_logits(arch, compile, share):
    cpu_model = bridged(arch)
    model = copy.deepcopy(cpu_model).to(CUDA)
    torch.manual_seed(0)
    prompts = [torch.randint(7, 97, (n,)).tolist() for n in (5, 2, 9, 3)]  # ragged
    cfg = SamplingConfig(
        n=8, width=4, max_new_tokens=20, temperature=0.9, top_p=0.9, seed=3, compile=compile, max_batch_sequences=16,
        share_prompts=share,  # True: each prompt's keys held once (bridgelm.prompt_attention) on the GPU too
    )
    results = generate_ids(model, prompts, cfg, EOS, 0)
    lengths = [len(s.token_ids) for r in results for s in r]
    assert min(lengths) < 20 and max(lengths) == 20  # some finished early: compaction / bucket moves happened
    want = teacher_forced_logprobs(cpu_model, prompts, results, 4, 0.9)
    for s, ref in zip([s for r in results for s in r], want):
        assert s.finished == (s.token_ids[-1] in EOS)
        torch.testing.assert_close(torch.tensor(s.logprobs), ref, atol=2e-3, rtol=0)
    on_cpu = generate_ids(cpu_model, prompts, replace(cfg, compile=False), EOS, 0)
    assert [s.token_ids for r in on_cpu for s in r] == [s.token_ids for r in results for s in r]  # same draws


def test_grouped_logits_of_a_gpu_model_takes_inputs_built_on_the_cpu():
    """The GPU check's first run (issue 47): inputs made on the CPU for a model on the GPU failed in the embedding."""
    cpu_model = bridged()
    ids = torch.randint(7, 97, (4, 6))
    mask = torch.ones_like(ids)
    want = bridgelm.grouped_logits(cpu_model, ids, mask, [0, 0, 1, 1])
    got = bridgelm.grouped_logits(copy.deepcopy(cpu_model).to(CUDA), ids, mask, [0, 0, 1, 1])
    torch.testing.assert_close(got.cpu(), want, atol=2e-4, rtol=0)


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_gpu_draws_equal_cpu_draws_when_rows_need_many_attempts(compile):
    """A small nucleus of flat rows: many rows have no accepted draw within the GPU sampler's sync-free rounds, and
    the step is completed after the sync (bridgelm.engine.sampler.finish_deferred). The samples equal the CPU's."""
    cpu_model = bridged()
    model = copy.deepcopy(cpu_model).to(CUDA)
    prompts = [[7, 8, 9, 10], [11, 12, 13], [20, 21]]
    cfg = SamplingConfig(n=4, width=2, max_new_tokens=16, temperature=1.5, top_p=0.05, seed=6, compile=compile)
    got = generate_ids(model, prompts, cfg, EOS, 0)
    want = generate_ids(cpu_model, prompts, replace(cfg, compile=False), EOS, 0)
    assert [s.token_ids for r in got for s in r] == [s.token_ids for r in want for s in r]


def test_compiled_step_reuses_its_graphs_across_calls():
    """A second call with the same shapes adds no compilation (CUDA graphs are replayed, not re-recorded)."""
    import torch._dynamo.utils as dynamo_utils

    model = bridged().to(CUDA)
    prompts = [[7, 8, 9, 10], [11, 12, 13]]
    cfg = SamplingConfig(n=4, width=2, max_new_tokens=8, temperature=1.0, top_p=1.0, seed=1, compile=True)
    first = generate_ids(model, prompts, cfg, [], 0)
    frames = dict(dynamo_utils.counters["stats"])
    again = generate_ids(model, prompts, cfg, [], 0)
    assert dict(dynamo_utils.counters["stats"]).get("unique_graphs") == frames.get("unique_graphs")
    assert [s.token_ids for r in first for s in r] == [s.token_ids for r in again for s in r]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_decode_attention_takes_the_matmul_path(monkeypatch, dtype):
    """On CUDA every decode call (one query per row) computes its attention with `matmul_attention`, in float32
    too; the prefill's calls (several queries per row) stay with sdpa. The compiled step draws inside its graph:
    the eager sampler runs once per wave (the prefill's logits)."""
    from bridgelm import attention
    from bridgelm.engine import sampler

    calls, draws = [], []
    real, real_draws = attention.matmul_attention, sampler.sample_tokens_deferred
    monkeypatch.setattr(attention, "matmul_attention", lambda q, *a: calls.append(q.shape[2]) or real(q, *a))
    monkeypatch.setattr(sampler, "sample_tokens_deferred", lambda *a: draws.append(1) or real_draws(*a))
    model = bridged(dtype=dtype).to(CUDA)
    cfg = SamplingConfig(n=2, width=2, max_new_tokens=4, temperature=0.9, top_p=0.9, compile=False)
    generate_ids(model, [[7, 8, 9], [10, 11]], cfg, [], 0)
    assert calls == [1] * (3 * model.config.num_hidden_layers)  # 3 decode steps after the prefill's token
    assert len(draws) == 4  # eager: every step
    draws.clear()
    generate_ids(model, [[7, 8, 9], [10, 11]], replace(cfg, compile=True), [], 0)
    assert len(draws) == 1


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_gpu_greedy_equals_transformers(arch):
    model = tiny_model(arch).to(CUDA)
    torch.manual_seed(2)
    prompts = [torch.randint(7, 97, (n,)).tolist() for n in (6, 3, 8)]
    results = generate_ids(model, prompts, SamplingConfig(n=2, width=1, max_new_tokens=12, temperature=0.0), [], 0)
    for prompt, samples in zip(prompts, results):
        ref = model.generate(
            torch.tensor([prompt], device=CUDA), max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0
        )[0, len(prompt) :].tolist()
        assert all(s.token_ids == ref for s in samples)


def test_gpu_bf16_logprobs_follow_grouped_logits():
    model = bridged(dtype=torch.bfloat16).to(CUDA)
    torch.manual_seed(8)
    prompts = [torch.randint(7, 97, (n,)).tolist() for n in (4, 6)]
    cfg = SamplingConfig(n=4, width=2, max_new_tokens=10, temperature=1.0, top_p=1.0, seed=2)
    results = generate_ids(model, prompts, cfg, EOS, 0)
    want = torch.cat(teacher_forced_logprobs(model.float().cpu(), prompts, results, 2, 1.0))
    got = torch.cat([torch.tensor(s.logprobs) for r in results for s in r])
    assert torch.isfinite(got).all() and (got - want).abs().mean() < 0.05


def test_gpu_grpo_minibatch_equals_cpu():
    """Loss and gradients of one GRPO mini-batch (8 Bridge groups, ragged rows) on the GPU and on the CPU."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent / "dist_scripts"))
    import rl_dist

    from bridgelm.dist import Dist

    cpu = rl_dist.minibatch_grads(Dist(), fsdp=False)
    gpu = rl_dist.minibatch_grads(Dist(device=CUDA), fsdp=False)
    assert gpu["tokens"] == cpu["tokens"]
    assert gpu["loss"] == pytest.approx(cpu["loss"], rel=1e-5, abs=1e-6)
    for name, want in cpu["grads"].items():
        torch.testing.assert_close(gpu["grads"][name].cpu(), want, rtol=1e-4, atol=1e-5, msg=name)


def test_gpu_rl_run_trains_the_blocks(tmp_path):
    """`train_rl` with the model on the GPU (bf16 autocast) runs end to end and trains the blocks."""
    from test_rl import CFG, TASK, TOK, policy

    from bridgelm.train.rl import train_rl

    model = policy().to(CUDA)
    before = {k: v.detach().clone() for k, v in bridgelm.added_parameters(model).items()}
    res = train_rl(model, TOK, TASK, replace(CFG, steps=2, optim=replace(CFG.optim, bf16=True)), tmp_path / "rl")
    assert [r["step"] for r in res.history] == [1, 2]
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in res.history)
    after = bridgelm.added_parameters(model)
    assert all(p.device.type == "cuda" for p in after.values())
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_gpu_sft_follows_cpu_sft(tmp_path):
    """The SFT warm-up on the GPU starts from the CPU run's blocks and follows its loss step by step (fp32, same
    data and order). Weights are not compared: Adam's first step moves a weight by about lr x sign(gradient),
    so a gradient that rounds to the other sign of zero moves it the other way; the losses show such drift."""
    from test_sft import CFG, TOK, base_model, write_warmup

    from bridgelm.train import sft
    from bridgelm.train.sft import train_sft

    data = write_warmup(tmp_path / "w.jsonl")
    cfg = replace(CFG, epochs=2, optim=replace(CFG.optim, lr=1e-3))
    cpu, gpu = sft.ensure_blocks(base_model(), cfg), sft.ensure_blocks(base_model().to(CUDA), cfg)
    cpu_blocks, gpu_blocks = bridgelm.added_parameters(cpu), bridgelm.added_parameters(gpu)
    assert cpu_blocks and all(torch.equal(gpu_blocks[k].cpu(), cpu_blocks[k]) for k in cpu_blocks)  # same seed
    want = train_sft(cpu, TOK, data, cfg, tmp_path / "cpu").history
    got = train_sft(gpu, TOK, data, cfg, tmp_path / "gpu").history
    assert [r["step"] for r in got] == [r["step"] for r in want] and len(want) >= 4
    for g, w in zip(got, want):
        assert g["loss"] == pytest.approx(w["loss"], rel=2e-4), g["step"]
    assert want[-1]["loss"] != want[0]["loss"]  # it trained
