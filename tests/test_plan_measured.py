"""bridgelm plan's rows against what a real run holds, measured on 2 CPU ranks (torchrun, gloo).

One launch of tests/dist_scripts/plan_measured.py runs test_rl's tiny Bridge model through rl.train_rl for 2 steps
under --fsdp --bf16 with a reference, and reads each rank's bytes from the run's own objects (local
shards of parameters, gradients and AdamW's moments; the bf16 rollout copy; the reference) and from the CPU
allocator (the start-up peak). The plan is made here for the same model, from its transformers config.

Tolerances, and why:
- sharded rows (weights, gradients, optimiser, reference): FSDP2 cuts each parameter's dim 0 into chunks of
  ceil(d / W) rows, so a rank holds d / W rows exactly when W divides d, else up to one row more or less: each rank
  within one row of every such parameter (here the 25-token embedding and head), the ranks together exactly W x the
  plan's row (nothing lost or counted twice);
- optimiser: AdamW's per-parameter `step` counters (a float32 scalar a trained tensor) are not in the plan's row;
- rollout replica: exact (a plain copy, each tensor once);
- start-up: the allocator's peak from before the model is built until the learner is made: the whole fp32 policy
  (the plan's row) plus, while FSDP shards a decoder layer, that layer's new shards beside its whole parameters
  (one layer's P x b / W), plus the buffers (rotary frequencies); what is held when the learner is made: the
  policy's and the reference's shards alone (the whole policy freed, no second whole model at any time).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bridgelm import plan
from bridgelm.shape import shape_of
from bridgelm.attach import add_bridge
from bridgelm.layout import decoder_layers
from bridgelm.engine import encode_prompts
from bridgelm.params import meta_model

SCRIPT = Path(__file__).parent / "dist_scripts" / "plan_measured.py"
sys.path.insert(0, str(SCRIPT.parent))
W = 2


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("plan_measured")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(W), str(SCRIPT), str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((out / f"measured_rank{r}.json").read_text()) for r in range(W)]


@pytest.fixture(scope="module")
def planned():
    """The plan's rows for the measured run, its model planned from the transformers config alone (meta device)."""
    from plan_measured import run_config
    from test_rl import TASK, TOK, policy

    shape_model = add_bridge(meta_model(config=policy(blocks=False).config))  # the blocks as policy() adds them
    cfg = run_config()
    prompts = encode_prompts(TOK, [TASK.prompt(ex) for ex in TASK.examples], cfg.chat)
    setup = plan.Setup(shape_of(shape_model), cfg, W, "float32", max(map(len, prompts)))
    return setup.rows(), shape_model


def uneven_rows(model, b: int = 4) -> int:
    """Bytes of one dim-0 row of each parameter whose dim 0 W does not divide: how far a rank's FSDP2 shards can be
    from P x b / W."""
    return sum(p[0].numel() * b for p in model.parameters() if p.shape[0] % W)


@pytest.mark.parametrize("row", ["weights", "gradients", "reference"])
def test_sharded_rows_are_what_each_rank_holds(measured, planned, row):
    rows, shape_model = planned
    got = [max(m["grads"]) if row == "gradients" else m[row] for m in measured]
    assert sum(got) == W * rows[row]  # exactly: P x 4 bytes over the ranks (every parameter trained here)
    slack = uneven_rows(shape_model)
    assert slack == 2 * 64 * 4  # the 25-token embedding and head: one row of 64 values each
    assert all(abs(g - rows[row]) <= slack for g in got), (got, rows[row])
    assert got[0] != got[1]  # the uneven split is real (rank 0 holds 13 of the 25 rows)


def test_gradients_are_held_at_every_optimiser_step(measured, planned):
    rows, _ = planned
    for m in measured:
        assert len(m["grads"]) == 4  # 2 steps x 2 mini-batches
        assert len(set(m["grads"])) == 1  # every trained tensor has its gradient shard at each step


def test_optimiser_row_is_adamw_moments(measured, planned):
    rows, shape_model = planned
    moments = [m["optimiser"]["moments"] for m in measured]
    assert sum(moments) == W * rows["optimiser"]  # exp_avg and exp_avg_sq, fp32, sharded as the parameters
    assert all(abs(g - rows["optimiser"]) <= 2 * uneven_rows(shape_model) for g in moments)
    for m in measured:  # besides: AdamW's step counters, a float32 scalar a trained tensor, not in the plan
        assert m["optimiser"]["other"] == 4 * m["trained tensors"]


def test_rollout_replica_is_the_bf16_copy(measured, planned):
    rows, _ = planned
    assert rows["rollout replica"] > 0 and rows["rollout model"] == 0
    assert [m["rollout replica"] for m in measured] == [rows["rollout replica"]] * W  # exact: P x 2 bytes


def test_reference_is_resharded_after_its_passes(measured, planned):
    """After 2 steps of reference forwards the reference holds its shards alone: FSDP2 would keep its root (embedding,
    head, final norm) gathered after a forward without a backward, parameters that are then whole tensors (in bf16
    here: as many bytes as their fp32 shards on 2 ranks, so the bytes alone would not tell)."""
    rows, shape_model = planned
    assert [m["reference gathered"] for m in measured] == [0] * W
    assert all(abs(m["reference"] - rows["reference"]) <= uneven_rows(shape_model) for m in measured)


def test_start_up_peak_is_one_whole_policy(measured, planned):
    rows, shape_model = planned
    layer = max(sum(p.numel() for p in block.parameters()) for block in decoder_layers(shape_model)) * 4 // W
    buffers = 4096
    for m in measured:
        peak, held = m["startup"]["peak"], m["startup"]["held"]
        assert rows["start-up"] <= peak <= rows["start-up"] + layer + buffers, (peak, rows["start-up"], layer)
        assert peak < rows["start-up"] + rows["reference"]  # never a second whole model, nor half of one
        shards = rows["weights"] + rows["reference"]
        assert abs(held - shards) <= 2 * uneven_rows(shape_model) + buffers, (held, shards)  # the whole one freed


def test_activations_are_what_autograd_keeps(measured, planned):
    """Each training micro-batch's saved tensors against plan.layer_bytes and the head's terms: exact but for the
    rotary cos/sin (kept once a forward, shared by its rows and layers) and, after the layers, the boolean masks and
    the GRPO loss's few float32 values a response position, a row (its advantage) and a micro-batch (scalars). The attention's own are the CPU's (scores, and a Bridge
    block's sdpa in float32 under CPU autocast), not the GPU sdpa's that the plan counts: measured, not compared."""
    _, shape_model = planned
    s, a = shape_of(shape_model), 2  # bf16
    kept, _ = plan.layer_bytes(s, a)
    batches = [b for m in measured for b in m["saved"]]
    assert len(batches) == 2 * 4  # 2 ranks x 2 steps x 2 mini-batches of one micro-batch
    for b in batches:
        tokens, scored = b["rows"] * b["tokens"], b["scored"]
        rotary = 2 * b["tokens"] * s.head_dim * a
        assert 0 <= b["layers"] - tokens * s.layers * kept <= rotary, b
        head = tokens * plan.norm_bytes(s.hidden, a) + scored * (a * s.hidden + a * s.vocab + 12)
        assert 0 <= b["head"] - head <= 2 * tokens + 24 * scored + 8 * b["rows"] + 16, b  # + a row's, a scalar's
        assert b["attention"] > 0


def test_gathered_weights_bound_what_fsdp_holds_whole_in_the_update(measured, planned):
    """During the training forwards and backwards FSDP2 holds the root unit and a decoder layer whole (bf16), and
    whole gradients before their reduce-scatter: the plan's row counts the root, two layers (the second one prefetched:
    on CUDA its all-gather runs ahead; the CPU ranks here gather it when it computes) and at most the root's and a
    layer's trained gradients."""
    rows, shape_model = planned
    s, a = shape_of(shape_model), 2  # bf16
    for m in measured:
        params, grads = m["gathered"]["params"], m["gathered"]["grads"]
        assert params == a * (s.root_params + s.layer_params)  # the root and the layer computing, exactly
        assert a * s.layer_params <= grads <= a * (s.root_params + s.layer_params)
        assert params + grads <= rows["gathered weights"] == a * (2 * s.root_params + 3 * s.layer_params)
        assert rows["gathered weights"] - (params + grads) <= a * (s.root_params + s.layer_params)
