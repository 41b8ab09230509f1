"""The engine's host syncs, counted on the CPU: every call that would make the host wait for a GPU (a value read back,
an op whose output size depends on values), unless it reads a tensor already copied to the host with `.cpu()` (the
copy itself counts). On a GPU each one leaves the device idle while the host catches up; benchmarks/gpu_check.py's
host_syncs row counts the real ones there."""

import torch
from conftest import tiny_model
from torch.utils._python_dispatch import TorchDispatchMode

import bridgelm
from bridgelm.engine import SamplingConfig, generate_ids, sampler

SYNCING_OPS = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.masked_select.default"}


class HostSyncs(TorchDispatchMode):
    """Counts syncing calls made outside `model` (its forward is transformers' code, not the engine's)."""

    def __init__(self, model):
        super().__init__()
        self.count, self.on_host, self.in_model = 0, {}, 0  # on_host: id -> tensor (kept alive: ids stay unique)
        self.hooks = [model.register_forward_pre_hook(lambda *_: self._model(1)),
                      model.register_forward_hook(lambda *_: self._model(-1))]

    def _model(self, by: int):
        self.in_model += by

    def _host(self, t) -> bool:
        while isinstance(t, torch.Tensor):
            if id(t) in self.on_host:
                return True
            t = t._base
        return False

    def _read(self, t: torch.Tensor) -> bool:
        return not (self.in_model or self._host(t))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        sized = (kwargs or {}).get("output_size") is not None
        if name in SYNCING_OPS or (name == "aten.repeat_interleave.Tensor" and not sized):
            self.count += self._read(args[0])
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and any(map(self._host, args)):  # made from host copies: on the host too
            self.on_host[id(out)] = out
        return out

    def __enter__(self):
        self.tolist, self.cpu = torch.Tensor.tolist, torch.Tensor.cpu
        counter = self

        def tolist(t):
            counter.count += counter._read(t)
            return counter.tolist(t)

        def cpu(t, *args, **kwargs):
            counter.count += not counter.in_model
            copy = counter.cpu(t, *args, **kwargs).clone()  # on the CPU, .cpu() returns the tensor itself
            counter.on_host[id(copy)] = copy
            return copy

        torch.Tensor.tolist, torch.Tensor.cpu = tolist, cpu
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist, torch.Tensor.cpu = self.tolist, self.cpu
        for hook in self.hooks:
            hook.remove()
        return super().__exit__(*exc)


def _syncs(model, prompts: int, tokens: int) -> int:
    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(5, model.config.vocab_size, (int(n),), generator=g).tolist()
           for n in torch.randint(3, 12, (prompts,), generator=g)]
    cfg = SamplingConfig(n=4, width=4, max_new_tokens=tokens, temperature=0.8, top_p=1.0)
    with HostSyncs(model) as counter:
        generate_ids(model, ids, cfg, eos_token_ids=[], pad_token_id=0)
    return counter.count


def test_one_host_sync_per_decode_step_and_a_few_per_call_whatever_the_rows(monkeypatch):
    """With the draws a GPU makes (deferred, no sync of their own): one sync per step (the loop's StepEnd), and a
    fixed few per call, the same for 8 and 16 prompts (the samples reach the host in one copy per tensor, not a
    read per row)."""
    monkeypatch.setattr(sampler, "defers_draws", lambda device, cfg: True)
    model = tiny_model()
    bridgelm.add_bridge(model)
    short, long, wide = _syncs(model, 8, 16), _syncs(model, 8, 48), _syncs(model, 16, 16)
    assert (long - short) / 32 == 1, (short, long)
    assert wide == short and short - 16 <= 4, (short, wide)  # a copy each of tokens, log-probs, lengths, ended
