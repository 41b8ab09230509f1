"""Run by tests/test_plan_measured.py under torchrun (2 CPU processes, gloo): the memory `bridgelm plan` counts,
measured on each rank of a real 2-step GRPO run (rl.train_rl, --fsdp --bf16, a reference).

What the plan counts is read from the run's own objects (wrapping rl's `_learner`, `RolloutPolicy` and
`update_policy` to keep hold of them), never from the plan's formulas:
- weights, reference: the bytes of each parameter's local shard (DTensor.to_local()) of the policy, the reference
  (and the reference's parameters that are whole tensors: those FSDP2 holds gathered, not sharded);
- gradients: the local shards of the trained parameters' gradients, at each optimiser step (a step pre-hook);
- optimiser: AdamW's exp_avg and exp_avg_sq local shards (its per-parameter `step` counters apart);
- rollout replica: the bf16 copy's parameters (each tensor once);
- start-up: the CPU allocator's own account (torch.profiler, profile_memory=True) of what was allocated and freed
  from before the model is built (so that the frees of its whole parameters are seen) until the learner is made:
  its peak, and what is still held at the end;
- activations: what the policy's training forwards keep for their backward (autograd's saved tensors);
- gathered weights: the parameters FSDP holds whole (its groups in the unsharded state) and their whole gradients,
  the largest sum seen at a decoder layer's forward or backward.
The update's own peak is not measured with the allocator: FSDP's collectives free on gloo's worker threads, which
the profiler does not see (their blocks would count as held until their addresses are allocated again).

Writes OUT/measured_rank{R}.json.

    torchrun --nproc_per_node 2 tests/dist_scripts/plan_measured.py OUT_DIR
"""

import json
import os
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ (conftest, test_rl)

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from bridgelm.dist import setup_distributed, teardown_distributed  # noqa: E402
from bridgelm.train import rl  # noqa: E402

CFG_CHANGES = dict(steps=2, prompts_per_step=2, fsdp=True, beta=0.05)


def run_config():
    """The run measured (and planned by the test): test_rl's tiny GRPO run under FSDP in bf16."""
    from test_rl import CFG

    return replace(CFG, optim=replace(CFG.optim, bf16=True), run=replace(CFG.run, save_every=0), **CFG_CHANGES)


def local_bytes(tensors) -> int:
    """Bytes of the tensors' local parts (a DTensor's shard on this rank), each tensor once."""
    seen, total = set(), 0
    for t in tensors:
        if t is None or id(t) in seen:
            continue
        seen.add(id(t))
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


class Window:
    """The CPU allocator's account of one stretch of the run, on this process's main thread (the profiler sees no
    other): the peak of the bytes allocated and not yet freed since it opened, and those still held when it closed.
    A block freed on another thread is not seen freed: it is counted until its address is allocated again."""

    def __init__(self):
        self.prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self.prof.start()

    def close(self) -> dict:
        self.prof.stop()
        with tempfile.TemporaryDirectory() as tmp:
            self.prof.export_chrome_trace(f"{tmp}/trace.json")
            events = json.loads(Path(f"{tmp}/trace.json").read_text())["traceEvents"]
        live, held, peak = {}, 0, 0
        for e in sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"]):
            addr, size = e["args"]["Addr"], e["args"]["Bytes"]
            held -= live.pop(addr, 0) if size > 0 else 0  # allocated again: freed where the profiler did not see
            if size > 0:
                live[addr] = size
                held += size
            elif addr in live:  # not a block allocated before the window
                held -= live.pop(addr)
            peak = max(peak, held)
        return {"peak": peak, "held": held}


class SavedForBackward:
    """What the policy's training forwards keep for their backward (autograd's saved tensors, each storage once,
    parameters aside: FSDP gathers those again for the backward), per micro-batch: its rows, padded tokens and scored
    positions (the head's rows), and the bytes kept inside the attention calls (sdpa, the CPU's two-matmul
    attention), elsewhere in the decoder layers, and after them (final norm, head, log-probs, loss)."""

    def __init__(self, model):
        from bridgelm import attention
        from bridgelm.layout import decoder_layers

        self.model, self.batches, self.where, self.seen = model, [], "embed", set()
        layers = decoder_layers(model)
        model.register_forward_pre_hook(self.start, with_kwargs=True)
        layers[0].register_forward_pre_hook(lambda *a: self.enter("layers"))
        layers[-1].register_forward_hook(lambda *a: self.enter("head"))
        model.get_output_embeddings().register_forward_hook(self.scored)
        torch.nn.functional.scaled_dot_product_attention = self.tagged(torch.nn.functional.scaled_dot_product_attention)
        attention.matmul_attention = self.tagged(attention.matmul_attention)
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)

    def start(self, module, args, kwargs):
        if torch.is_grad_enabled():
            rows, tokens = kwargs["input_ids"].shape
            self.batches.append({"rows": rows, "tokens": tokens, "layers": 0, "attention": 0, "head": 0, "embed": 0})
            self.seen, self.where = set(), "embed"

    def enter(self, where: str) -> None:
        self.where = where

    def scored(self, module, args, out):
        if torch.is_grad_enabled():
            self.batches[-1]["scored"] = out.shape[0]  # [N, V]: the head sees the response positions only

    def tagged(self, fn):
        def call(*args, **kwargs):
            before, self.where = self.where, "attention" if self.where == "layers" else self.where
            try:
                return fn(*args, **kwargs)
            finally:
                self.where = before

        return call

    def pack(self, t):
        storage = t.untyped_storage()
        params = {p.untyped_storage().data_ptr() for p in self.model.parameters() if not hasattr(p, "to_local")}
        if self.batches and storage.data_ptr() not in self.seen | params:
            self.seen.add(storage.data_ptr())
            self.batches[-1][self.where] += storage.nbytes()
        return t


class Gathered:
    """The policy's parameters FSDP holds gathered (whole, in the compute dtype) during the training forwards and
    backwards, and the whole gradients computed into them before their reduce-scatter: the largest sum seen at any
    decoder layer's forward or backward, read from FSDP2's parameter groups (those in the unsharded state)."""

    def __init__(self, model):
        from torch.distributed.fsdp import FSDPModule

        from bridgelm.layout import decoder_layers

        self.groups = [g for m in model.modules() if isinstance(m, FSDPModule)
                       for g in [m._get_fsdp_state()._fsdp_param_group] if g is not None]  # fmt: skip
        self.peak = {"params": 0, "grads": 0}
        for layer in decoder_layers(model):
            for hook in (layer.register_forward_pre_hook, layer.register_forward_hook,
                         layer.register_full_backward_pre_hook, layer.register_full_backward_hook):  # fmt: skip
                hook(lambda *a: self.look())

    def look(self) -> None:
        if not torch.is_grad_enabled() and not torch._C._current_graph_task_id() >= 0:
            return  # a no-grad forward (none of the policy's under a replica): not the update
        whole = [fp._unsharded_param for g in self.groups if g.is_unsharded for fp in g.fsdp_params
                 if hasattr(fp, "_unsharded_param")]  # fmt: skip
        params = sum(p.numel() * p.element_size() for p in whole)
        grads = sum(p.grad.numel() * p.grad.element_size() for p in whole if p.grad is not None)
        if params + grads > sum(self.peak.values()):
            self.peak = {"params": params, "grads": grads}


def optimiser_state(optimizer) -> dict:
    moments = [s[k] for s in optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")]
    other = [v for s in optimizer.state.values() for k, v in s.items() if k not in ("exp_avg", "exp_avg_sq")]
    return {"moments": local_bytes(moments), "other": local_bytes([v for v in other if torch.is_tensor(v)])}


def measure(out: Path) -> dict:
    """Run the 2 steps with the wrappers in place; what they measured."""
    from test_rl import TASK, TOK, policy

    seen, got = {}, {"grads": []}
    original = {name: getattr(rl, name) for name in ("_learner", "RolloutPolicy", "update_policy")}

    def learner(*args, **kwargs):
        made = seen["learner"] = original["_learner"](*args, **kwargs)
        got["startup"] = seen.pop("startup").close()
        seen["saved"] = SavedForBackward(made.model)
        seen["gathered"] = Gathered(made.model)
        made.optimizer.register_step_pre_hook(lambda opt, a, k: got["grads"].append(
            local_bytes(p.grad for p in made.params)))  # fmt: skip
        return made

    def rollout_policy(*args, **kwargs):
        made = seen["sampler"] = original["RolloutPolicy"](*args, **kwargs)
        return made

    def update_policy(*args, **kwargs):
        with seen["saved"].hooks:
            return original["update_policy"](*args, **kwargs)

    rl._learner, rl.RolloutPolicy, rl.update_policy = learner, rollout_policy, update_policy
    try:
        seen["startup"] = Window()  # before the model exists: its whole parameters' frees are seen
        model = policy(seed=3)
        rl.train_rl(model, TOK, TASK, run_config(), out / "run")
    finally:
        for name, fn in original.items():
            setattr(rl, name, fn)
    learn, sampler = seen["learner"], seen["sampler"]
    replica = {id(p): p for p in sampler.replica.parameters()}.values()
    return {
        **got,
        "weights": local_bytes(learn.model.parameters()),
        "reference": local_bytes(learn.ref_model.parameters()),
        "reference gathered": local_bytes(p for p in learn.ref_model.parameters() if not hasattr(p, "to_local")),
        "optimiser": optimiser_state(learn.optimizer),
        "rollout replica": local_bytes(replica),
        "trained tensors": len(learn.params),
        "saved": seen["saved"].batches,
        "gathered": seen["gathered"].peak,
    }


def main(out: str) -> None:
    out = Path(out)
    torch.set_num_threads(1)
    dist = setup_distributed("cpu")
    measured = measure(out)
    (out / f"measured_rank{dist.rank}.json").write_text(json.dumps(measured, indent=1))
    teardown_distributed()


if __name__ == "__main__":
    main(sys.argv[1])
