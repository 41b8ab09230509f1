"""Shared training plumbing: schedules, checkpoints, RNG, grouped batches and their log-probs."""

import random

import pytest
import torch
from conftest import randomize_blocks, tiny_model

import bridgelm
from bridgelm import jsonl, logprobs, rng, runs
from bridgelm.jsonl import read_records
from bridgelm.logprobs import Row
from bridgelm.train import checkpoints, optim, weights
from bridgelm.train.loop import MetricsLog


def _lrs(total, warmup_fraction, decay, lr=1.0):
    p = torch.nn.Parameter(torch.zeros(1))
    opt = optim.make_optimizer([p], lr)
    sched = optim.make_scheduler(opt, total, warmup_fraction, decay)
    out = []
    for _ in range(total):
        out.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    return out


def test_constant_schedule_with_warmup():
    lrs = _lrs(20, 0.1, "constant")  # 2 warm-up steps
    assert lrs[:3] == pytest.approx([1 / 3, 2 / 3, 1.0])
    assert lrs[2:] == [1.0] * 18


def test_linear_schedule_with_warmup():
    lrs = _lrs(10, 0.2, "linear")  # 2 warm-up steps, then 8 decaying
    assert lrs[:2] == pytest.approx([1 / 3, 2 / 3])
    assert lrs[2:] == pytest.approx([(10 - s) / 8 for s in range(2, 10)])
    assert all(a > b for a, b in zip(lrs[2:], lrs[3:])) and lrs[-1] > 0


def test_schedule_errors():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = optim.make_optimizer([p], 1.0)
    with pytest.raises(AssertionError, match="decay="):
        optim.make_scheduler(opt, 10, 0.1, "cosine")
    with pytest.raises(ValueError, match="warmup_fraction=1.5: expected a finite number in \\[0, 1\\)"):
        optim.OptimConfig(warmup_fraction=1.5).validate()  # the one check, before make_scheduler
    with pytest.raises(ValueError, match="no trainable"):
        optim.make_optimizer([], 1.0)


def test_scheduler_and_optimizer_state_round_trip(tmp_path):
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(3))
    opt = optim.make_optimizer([p], 0.1)
    sched = optim.make_scheduler(opt, 10, 0.3, "linear")
    for _ in range(4):
        p.grad = torch.ones(3)
        opt.step()
        sched.step()
    checkpoints.save_trainer_state(tmp_path, 4, opt.state_dict(), sched, {"best": {"x": 1.5}})
    state = checkpoints.load_trainer_state(tmp_path)
    q = torch.nn.Parameter(p.detach().clone())
    opt2 = optim.make_optimizer([q], 0.1)
    sched2 = optim.make_scheduler(opt2, 10, 0.3, "linear")
    opt2.load_state_dict(state["optimizer"])
    sched2.load_state_dict(state["scheduler"])
    assert state["step"] == 4 and state["extra"] == {"best": {"x": 1.5}}
    for _ in range(3):
        for param, o, s in ((p, opt, sched), (q, opt2, sched2)):
            param.grad = torch.ones(3)
            o.step()
            s.step()
        assert torch.equal(p, q) and sched.get_last_lr() == sched2.get_last_lr()


def test_rng_round_trip():
    state = rng.rng_state()
    a = (random.random(), torch.rand(3))
    rng.set_rng_state(state)
    b = (random.random(), torch.rand(3))
    assert a[0] == b[0] and torch.equal(a[1], b[1])


def test_rng_state_survives_weights_only_load(tmp_path):
    torch.save(rng.rng_state(), tmp_path / "rng.pt")
    state = torch.load(tmp_path / "rng.pt", weights_only=True)
    first = (random.random(), torch.rand(2))
    rng.set_rng_state(state)
    assert (random.random(), torch.rand(2))[0] == first[0]


def test_derived_seeds_are_stable_and_distinct():
    assert rng.derive_seed(0, "data", 3) == rng.derive_seed(0, "data", 3)
    assert len({rng.derive_seed(0, "data", s) for s in range(100)}) == 100
    assert rng.derive_seed(0, "data", 1) != rng.derive_seed(1, "data", 1)
    a = torch.rand(4, generator=rng.generator(5, "x"))
    assert torch.equal(a, torch.rand(4, generator=rng.generator(5, "x")))


def test_atomic_checkpoint_dir_and_keep_last(tmp_path):
    def writer(step):
        def write(tmp):
            (tmp / "weights.bin").write_bytes(bytes([step]))
            jsonl.write_json(tmp / checkpoints.TRAINER_INFO, {"step": step})

        return write

    for step in (1, 2, 3, 4):
        final = tmp_path / checkpoints.CHECKPOINTS / checkpoints.checkpoint_name(step)
        checkpoints.write_dir_atomic(final, writer(step))
        checkpoints.prune_checkpoints(tmp_path, keep_last=2)
    names = [p.name for p in checkpoints.list_checkpoints(tmp_path)]
    assert names == ["step-00000003", "step-00000004"]
    assert checkpoints.latest_checkpoint(tmp_path).name == "step-00000004"
    # a failing write leaves the previous directory intact and no temporary behind
    final = tmp_path / checkpoints.CHECKPOINTS / checkpoints.checkpoint_name(4)

    def broken(tmp):
        (tmp / "weights.bin").write_bytes(b"half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        checkpoints.write_dir_atomic(final, broken)
    assert (final / "weights.bin").read_bytes() == bytes([4])
    assert sorted(p.name for p in (tmp_path / checkpoints.CHECKPOINTS).iterdir()) == names
    # replacing an existing directory
    checkpoints.write_dir_atomic(final, writer(9))
    assert (final / "weights.bin").read_bytes() == bytes([9])
    # an incomplete checkpoint (no trainer.json) is not listed
    (tmp_path / checkpoints.CHECKPOINTS / "step-00000005").mkdir()
    assert checkpoints.latest_checkpoint(tmp_path).name == "step-00000004"


def test_config_check_names_fields(tmp_path):
    runs.check_settings(tmp_path, {"lr": 1.0, "steps": 3}, {"lr": 1.0, "steps": 3})
    with pytest.raises(ValueError, match=r"lr: saved 1.0 vs now 2.0"):
        runs.check_settings(tmp_path, {"lr": 1.0, "steps": 3}, {"lr": 2.0, "steps": 3})
    # a file's fingerprint: "changed" only at the same path; another path is another file, named by its path alone
    saved = {"blocks": "a.safetensors", "blocks_digest": "sha256:1"}
    with pytest.raises(ValueError, match=r"\(blocks: the file changed since the run began \(sha256:1 vs now sha256:2\)\)"):
        runs.check_settings(tmp_path, saved, {**saved, "blocks_digest": "sha256:2"})
    with pytest.raises(ValueError, match=r"\(blocks: saved 'a.safetensors' vs now 'b.safetensors'\)"):
        runs.check_settings(tmp_path, saved, {"blocks": "b.safetensors", "blocks_digest": "sha256:2"})


def test_fresh_run_refuses_a_used_directory(tmp_path):
    assert checkpoints.resume_point(tmp_path, resume=False) is None
    (tmp_path / runs.METRICS).write_text('{"step": 1}\n')
    with pytest.raises(ValueError, match="resume"):
        checkpoints.resume_point(tmp_path, resume=False)
    assert checkpoints.resume_point(tmp_path, resume=True) is None


def test_metrics_log_keep_until(tmp_path):
    log = MetricsLog(tmp_path / "metrics.jsonl")
    for s in (1, 2, 3):
        log.log({"step": s, "loss": float(s)})
    again = MetricsLog(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in again.records] == [1, 2, 3]
    again.keep_until(2)
    assert [r["step"] for r in read_records(tmp_path / "metrics.jsonl")] == [1, 2]


@pytest.mark.parametrize("tied", [False, True])
def test_load_weights_is_exact(tmp_path, tied):
    src = randomize_blocks(bridgelm.add_bridge(tiny_model(seed=1, tie_word_embeddings=tied)))
    src.save_pretrained(tmp_path)
    dst = bridgelm.add_bridge(tiny_model(seed=2, tie_word_embeddings=tied))
    weights.load_weights(dst, tmp_path)
    for (name, a), (_, b) in zip(src.state_dict().items(), dst.state_dict().items()):
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match="holds weights the model lacks"):
        weights.load_weights(tiny_model(seed=2, tie_word_embeddings=tied), tmp_path)
    deeper = bridgelm.add_bridge(tiny_model(seed=2, tie_word_embeddings=tied, num_hidden_layers=3))
    with pytest.raises(ValueError, match="lacks weights of the model"):
        weights.load_weights(deeper, tmp_path)


def _rows():
    g = torch.Generator().manual_seed(0)
    p1 = torch.randint(5, 90, (4,), generator=g).tolist()
    p2 = torch.randint(5, 90, (6,), generator=g).tolist()
    lens = [3, 5, 2, 4, 1, 6]
    resp = [torch.randint(5, 90, (n,), generator=g).tolist() for n in lens]
    return [Row(p1, resp[0], 7), Row(p1, resp[1], 7), Row(p1, resp[2], 7), Row(p2, resp[3], 3), Row(p2, resp[4], 3)]


def test_pack_rows_layout():
    rows = _rows()
    batch = logprobs.pack_rows(rows, pad_id=0)
    assert batch.input_ids.shape == (5, 10) and batch.response_mask.shape == (5, 5)
    assert batch.tokens == 3 + 5 + 2 + 4 + 1
    assert batch.attention_mask[1].tolist() == [1] * 9 + [0]
    assert batch.predict[1].nonzero()[:, 0].tolist() == [3, 4, 5, 6, 7]
    with pytest.raises(AssertionError, match="not next to its group"):
        logprobs.pack_rows([rows[0], rows[3], rows[1]], 0)
    with pytest.raises(AssertionError, match="another prompt"):
        logprobs.pack_rows([rows[0], rows[3]._replace(group=7)], 0)


@pytest.mark.parametrize("arch,temperature", [("qwen2", 1.0), ("qwen2", 0.6), ("llama", 0.6), ("qwen3", 0.6)])
def test_response_logprobs_match_grouped_logits(arch, temperature):
    """The trimmed forward (logits only at response positions) equals the full grouped_logits one."""
    model = randomize_blocks(bridgelm.add_bridge(tiny_model(arch)))
    rows = _rows()
    batch = logprobs.pack_rows(rows, pad_id=0)
    got = logprobs.response_logprobs(model, batch, temperature, with_entropy=True)
    logits = bridgelm.grouped_logits(model, batch.input_ids, batch.attention_mask, batch.group_ids)
    logp = torch.log_softmax(logits.float() / temperature, -1)
    for b, r in enumerate(rows):
        p, n = len(r.prompt), len(r.response)
        want = logp[b, p - 1 : p + n - 1].gather(-1, torch.tensor(r.response)[:, None])[:, 0]
        assert torch.allclose(got.logprobs[b, :n], want, atol=1e-5)
        assert torch.equal(got.logprobs[b, n:], torch.zeros(5 - n))
        ent = -(logp[b, p - 1 : p + n - 1].exp() * logp[b, p - 1 : p + n - 1]).sum(-1)
        assert torch.allclose(got.entropy[b, :n], ent, atol=1e-5)


def test_forward_logits_runs_the_head_on_response_positions_only():
    """The head reads only the [N, H] hidden states of `batch.predict` (in every transformers 5 release, 5.17's models
    refusing a 2D logits_to_keep), giving exactly what the 2D boolean logits_to_keep gives where transformers has it;
    the hook is gone afterwards, also after an error."""
    import transformers.modeling_utils as mu

    model = randomize_blocks(bridgelm.add_bridge(tiny_model()))
    batch = logprobs.pack_rows(_rows(), pad_id=0)
    seen = []
    head = model.get_output_embeddings()
    head.register_forward_hook(lambda m, args, out: seen.append(tuple(args[0].shape)))
    got = logprobs.forward_logits(model, batch)
    assert seen == [(batch.tokens, model.config.hidden_size)] and got.shape == (batch.tokens, 97)
    full = bridgelm.grouped_logits(model, batch.input_ids, batch.attention_mask, batch.group_ids)
    assert torch.allclose(got, full[batch.predict], atol=1e-5)
    if hasattr(mu, "slice_logits_to_keep"):  # transformers >= 5.23: its own 2D boolean form
        with torch.no_grad():
            groups = bridgelm.grouped.Groups.build(batch.group_ids, batch.attention_mask)
            kept = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False,
                         logits_to_keep=batch.predict, **{bridgelm.grouped.KWARG: groups}).logits
        assert torch.equal(got.detach(), kept)
    with pytest.raises(RuntimeError, match="boom"), logprobs._head_sees_only(model, batch.predict):
        raise RuntimeError("boom")
    seen.clear()
    model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
    assert seen == [(5, 10, model.config.hidden_size)]  # the whole sequence again: no hook left behind


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("with_entropy", [True, False])
def test_token_logprobs_equal_log_softmax_values_and_gradients(monkeypatch, dtype, temperature, with_entropy):
    """The chunked log-probs against log_softmax + gather under autograd: values, entropy and logit gradients, over
    chunks of 3 rows (the last one ragged)."""
    monkeypatch.setattr(logprobs, "chunk_rows", lambda vocab, device: 3)
    g = torch.Generator().manual_seed(5)
    logits = (4 * torch.randn(10, 37, generator=g)).to(dtype)
    targets = torch.randint(0, 37, (10,), generator=g)
    weights = torch.randn(10, generator=g)  # a loss that weighs each row's log-prob differently

    def run(fn):
        x = logits.clone().requires_grad_()
        lp, ent = fn(x)
        (lp * weights).sum().backward()
        return lp.detach(), ent, x.grad

    def reference(x):
        logp = torch.log_softmax(x.float() / temperature, -1)
        return logp.gather(-1, targets[:, None])[:, 0], -(logp.exp() * logp).sum(-1).detach()

    got = run(lambda x: logprobs.token_logprobs(x, targets, temperature, with_entropy=with_entropy))
    want = run(reference)
    assert got[2].dtype == dtype
    if with_entropy:
        assert not got[1].requires_grad
    else:
        assert got[1] is None
        got, want = (got[0], got[2]), (want[0], want[2])
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: a gradient may round to the neighbouring value
    for a, b in zip(got, want):
        assert torch.allclose(a.float(), b.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_logprobs_overwrite_puts_the_same_gradient_in_the_logits(monkeypatch, dtype):
    """`overwrite`: the logits' gradient, bit for bit the one of a fresh tensor, is written into the logits (chunks
    of 3 rows); a second backward through them fails instead of reading it."""
    monkeypatch.setattr(logprobs, "chunk_rows", lambda vocab, device: 3)
    g = torch.Generator().manual_seed(6)
    base = (4 * torch.randn(10, 37, generator=g)).to(dtype)
    targets = torch.randint(0, 37, (10,), generator=g)
    weights = torch.randn(10, generator=g)

    def run(overwrite):
        leaf = base.clone().requires_grad_()
        logits = leaf * 1  # a non-leaf, as a model's output
        lp, _ = logprobs.token_logprobs(logits, targets, 0.6, overwrite=overwrite)
        loss = (lp * weights).sum()
        loss.backward(retain_graph=True)
        return leaf.grad, logits.detach(), loss

    fresh, kept, _ = run(False)
    grad, overwritten, loss = run(True)
    assert torch.equal(grad, fresh)
    assert torch.equal(kept, base) and torch.equal(overwritten, fresh)  # d logits / d leaf is the identity
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    leaf = base.clone().requires_grad_()  # a leaf keeps its values: only an autograd output is overwritten
    lp, _ = logprobs.token_logprobs(leaf, targets, 0.6, overwrite=True)
    (lp * weights).sum().backward()
    assert torch.equal(leaf.detach(), base) and torch.equal(leaf.grad, fresh)


def test_response_logprobs_lets_the_backward_overwrite_its_logits(monkeypatch):
    seen = []
    real = logprobs.token_logprobs
    monkeypatch.setattr(logprobs, "token_logprobs", lambda *a, **k: seen.append(k.get("overwrite")) or real(*a, **k))
    model = bridgelm.add_bridge(tiny_model())
    rows = [logprobs.Row([5, 6, 7], [8, 9, 10], 0), logprobs.Row([5, 6, 7], [11, 12], 0)]
    logprobs.response_logprobs(model, logprobs.pack_rows(rows, 0)).logprobs.sum().backward()
    assert seen == [True]


def test_token_logprobs_masked_vocabulary_and_bad_temperature():
    """A logit of -inf (a vocabulary entry masked out) adds nothing to the entropy; temperature 0 is refused."""
    logits = torch.tensor([[2.0, float("-inf"), 0.5, -1.0]])
    lp, ent = logprobs.token_logprobs(logits, torch.tensor([2]), 1.0, with_entropy=True)
    p = torch.softmax(logits[0, [0, 2, 3]], 0)
    assert torch.allclose(ent, -(p * p.log()).sum()[None]) and torch.allclose(lp, p[1].log()[None])
    with pytest.raises(AssertionError, match="temperature=0"):
        logprobs.token_logprobs(logits, torch.tensor([2]), 0)


def test_gradient_parts_split_the_fused_projection():
    model = randomize_blocks(bridgelm.add_bridge(tiny_model("qwen2")), std=0.2)
    ids = torch.randint(7, 97, (4, 9))
    out = bridgelm.grouped_logits(model, ids, torch.ones_like(ids), [0, 0, 1, 1])
    out.float().pow(2).mean().backward()
    parts = optim.gradient_parts(model)
    assert set(parts) == {"bridge_q", "bridge_k", "bridge_v", "bridge_o", "bridge_norm", "base"}
    norms = optim.part_grad_norms(parts)
    # Slow reference: the rows of every layer's fused qkv gradient, by hand.
    sq = {"bridge_q": 0.0, "bridge_k": 0.0, "bridge_v": 0.0}
    for name, p in model.named_parameters():
        if name.endswith("bridge.qkv_proj.weight"):
            q, k, v = p.grad.chunk(3, dim=0)
            for key, g in zip(sq, (q, k, v)):
                sq[key] += float(g.pow(2).sum())
    for key, value in sq.items():
        assert norms[key] == pytest.approx(value**0.5, rel=1e-5)
        assert value > 0
    total = sum(float(p.grad.pow(2).sum()) for p in model.parameters() if p.grad is not None)
    assert sum(v**2 for v in norms.values()) == pytest.approx(total, rel=1e-5)


def test_make_optimizer_gives_blocks_their_own_rate():
    model = bridgelm.add_bridge(tiny_model("qwen2"))
    blocks = bridgelm.added_parameters(model)
    params = list(model.parameters())
    opt = optim.make_optimizer(params, 1e-4, lr_of={id(p): 1e-2 for p in blocks.values()})
    by_rate = {g["lr"]: g["params"] for g in opt.param_groups}
    assert set(by_rate) == {1e-4, 1e-2}
    assert {id(p) for p in by_rate[1e-2]} == {id(p) for p in blocks.values()}
    assert len(by_rate[1e-4]) + len(by_rate[1e-2]) == len(params)


def test_progress_fields_leave_out_values_not_there_yet():
    from bridgelm.train.loop import progress_fields

    shown = progress_fields(loss="0.512", kl=0.0012345678, val=None, ppl="", step=3, acc=0.5)
    assert shown == {"loss": "0.512", "kl": "0.001235", "step": "3", "acc": "0.5"}


def test_a_checkpoint_of_another_format_or_layout_is_refused_in_one_line(tmp_path):
    """trainer.json records the checkpoint format and its layout: whole weights and optimiser, or each FSDP rank's
    shards (torch.distributed.checkpoint); a resume reads only its own."""
    from bridgelm.errors import UserError

    folder = tmp_path / "step-00000001"
    folder.mkdir()
    jsonl.write_json(folder / checkpoints.TRAINER_INFO, {"step": 1})  # an older bridgelm's
    with pytest.raises(UserError, match=r"has no format version \(written by an older bridgelm\)") as err:
        checkpoints.check_layout(folder, sharded=False)
    assert "\n" not in str(err.value)
    info = {"step": 1, **runs.format_of("checkpoint"), "layout": "sharded"}
    jsonl.write_json(folder / checkpoints.TRAINER_INFO, info)
    checkpoints.check_layout(folder, sharded=True)
    with pytest.raises(UserError, match="holds sharded training state, and this run reads whole state: resume it "
                       "with --fsdp"):
        checkpoints.check_layout(folder, sharded=False)
    (folder / checkpoints.SHARDS).mkdir()  # shards without their metadata: damaged
    assert checkpoints.checkpoint_damage(folder).startswith("shards/.metadata")


def test_weights_are_written_with_the_mode_of_any_new_file(tmp_path):
    """safetensors makes its files 0o600; a saved block file and a checkpoint folder take the umask's mode instead,
    so that others of a team can read them (as every other output)."""
    import os

    from safetensors.torch import save_file

    mask = os.umask(0o022)
    try:
        model = bridgelm.add_bridge(tiny_model())
        blocks = bridgelm.save_blocks(model, tmp_path / "b.safetensors")
        final = checkpoints.write_dir_atomic(
            tmp_path / "ckpt", lambda tmp: save_file({"w": torch.zeros(2)}, str(tmp / "model.safetensors"))
        )
    finally:
        os.umask(mask)
    assert oct(os.stat(blocks).st_mode & 0o777) == oct(0o644)
    assert oct(os.stat(final / "model.safetensors").st_mode & 0o777) == oct(0o644)


def test_a_composite_models_checkpoint_reads_back_tensor_by_tensor(tmp_path):
    """Gemma 3 with its vision tower: a checkpoint's weights are written under the module's own names (transformers
    would write older ones, which a resume reading tensor by tensor did not find: "holds weights the model lacks"),
    and load back exactly, through a resume's reader, bridgelm.load_model and transformers alike."""
    from conftest import tiny_composite
    from transformers import AutoModelForCausalLM

    from bridgelm.tokenizer import char_tokenizer

    tok = char_tokenizer("0123456789+-=() abc\n")
    model = randomize_blocks(bridgelm.add_bridge(tiny_composite(vocab_size=len(tok))))
    weights.save_model(model, tok, tmp_path / "ckpt")
    resumed = bridgelm.add_bridge(tiny_composite(seed=1, vocab_size=len(tok)))
    weights.load_weights(resumed, tmp_path / "ckpt")
    want = model.state_dict()
    assert all(torch.equal(t, want[k]) for k, t in resumed.state_dict().items())
    ids = torch.randint(3, len(tok), (2, 5))
    logits = bridgelm.grouped_logits(model, ids, torch.ones_like(ids), [0, 0])
    folder = tmp_path / "ckpt"
    for loaded in (bridgelm.load_model(str(folder)), AutoModelForCausalLM.from_pretrained(folder)):
        assert torch.equal(bridgelm.grouped_logits(loaded.eval(), ids, torch.ones_like(ids), [0, 0]), logits)


def test_a_resume_from_other_starting_weights_says_what_may_differ():
    """rl records the sum of the weights it started from; a resume from others said only "initial_checksum: saved
    7173.37 vs now 7173.99"."""
    from bridgelm.errors import UserError
    from bridgelm.runs import check_settings

    with pytest.raises(UserError, match=r"initial_checksum: the weights the run started from summed to 1.5, the ones "
                                        r"given now to 2.5: another --blocks file, or a model or block file changed"):
        check_settings("run", {"initial_checksum": 1.5}, {"initial_checksum": 2.5})
