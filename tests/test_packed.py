"""Packed oneDNN weights (bridgelm.packed) against the plain nn.Linear they replace."""

import pytest
import torch
from conftest import randomize_blocks, tiny_model
from packaging.version import Version
from torch import nn

import bridgelm
from bridgelm import packed
from bridgelm.packed import packed_linears
from bridgelm.engine import SamplingConfig, generate_ids

needs_bf16 = pytest.mark.skipif(
    torch.bfloat16 not in packed.dtypes(), reason="this CPU's oneDNN has no bfloat16 support"
)
needs_fp32 = pytest.mark.skipif(
    torch.float32 not in packed.dtypes(), reason="float32 weights are packed on x86 CPUs with oneDNN only"
)


SHAPES = [((1, 48), 200), ((7, 48), 200), ((64, 48), 200), ((3, 100, 48), 200), ((64, 576), 1536), ((64, 1536), 576)]


def _plain_and_packed(layer: nn.Linear, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`layer(x)` outside and inside `packed_linears`, checking that the context switches the module, multiplies
    with the copy packed at entry (not the module's weight), and restores the module on exit."""
    with torch.no_grad():
        want = layer(x)
        weight = layer.weight.clone()
        with packed_linears(layer):
            assert "forward" in layer.__dict__  # switched
            got = layer(x)
            layer.weight.mul_(2)
            assert torch.equal(layer(x), got)  # the packed copy multiplies
        layer.weight.copy_(weight)
    assert "forward" not in layer.__dict__  # restored
    assert got.dtype == want.dtype and got.shape == want.shape
    return want, got


@needs_bf16
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape, out", SHAPES)
def test_packed_linear_equals_nn_linear_bit_for_bit(bias, shape, out):
    """Widths up to SmolLM2's (576 and 1536 features). Bit for bit from torch 2.13 (constraints.txt's); at the floor,
    torch 2.8, F.linear sums 576- and 1536-long rows in another order: a few outputs one bfloat16 rounding apart."""
    torch.manual_seed(0)
    layer = nn.Linear(shape[-1], out, bias=bias).to(torch.bfloat16)
    want, got = _plain_and_packed(layer, torch.randn(shape).to(torch.bfloat16))
    if Version(torch.__version__.split("+")[0]) >= Version("2.13"):
        assert torch.equal(got, want)
        return
    ulp = torch.finfo(torch.bfloat16).eps * want.float().abs().clamp(min=torch.finfo(torch.bfloat16).tiny)
    apart = (got.float() - want.float()).abs()
    assert bool((apart <= ulp).all()) and int((apart > 0).sum()) <= 1e-3 * want.numel()


@needs_fp32
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape, out", SHAPES)
def test_packed_float32_linear_is_as_exact_as_nn_linear(bias, shape, out):
    """float32: oneDNN's kernel, not ATen's BLAS, so not bit for bit; both against the product in float64."""
    torch.manual_seed(0)
    layer = nn.Linear(shape[-1], out, bias=bias)
    x = torch.randn(shape)
    with torch.no_grad():
        exact = nn.functional.linear(x.double(), layer.weight.double(), None if bias is False else layer.bias.double())
    want, got = _plain_and_packed(layer, x)
    tol = 4 * float((want.double() - exact).abs().max()) + 1e-6  # float32 rounding of a sum of shape[-1] products
    assert float((got.double() - exact).abs().max()) <= tol


@needs_bf16
def test_weights_are_packed_at_entry_and_grad_takes_the_module_path():
    torch.manual_seed(0)
    layer = nn.Linear(32, 16).to(torch.bfloat16)
    x = torch.randn(5, 32).to(torch.bfloat16)
    with torch.no_grad():
        with packed_linears(layer):
            before = layer(x)
        layer.weight.mul_(2)  # an RL step between two sampling calls
        with packed_linears(layer):
            after = layer(x)
        assert torch.equal(after, nn.functional.linear(x, layer.weight, layer.bias))
        assert not torch.equal(after, before)
    with packed_linears(layer):
        y = layer(x)  # grad enabled: the module's own forward, which autograd follows
    assert y.requires_grad and torch.equal(y.detach(), after)


@needs_bf16
def test_an_error_inside_the_context_restores_every_module():
    model = tiny_model(dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="stop"), packed_linears(model):
        assert any("forward" in m.__dict__ for m in model.modules())
        raise RuntimeError("stop")
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_which_dtypes_this_machine_packs(monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(torch.backends.mkldnn, "is_available", lambda: False)
        assert packed.dtypes() == ()
    monkeypatch.setattr(packed.platform, "machine", lambda: "aarch64")
    assert torch.float32 not in packed.dtypes()  # float32 keeps the BLAS off x86


@needs_fp32
def test_autocast_keeps_its_dtype_inside_the_context():
    """Under CPU bf16 autocast a float32 linear computes in bf16; the packed float32 kernel must not change that."""
    torch.manual_seed(0)
    layer = nn.Linear(48, 200)
    x = torch.randn(7, 48)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want = layer(x)
        with packed_linears(layer):
            got = layer(x)
    assert want.dtype == got.dtype == torch.bfloat16 and torch.equal(got, want)


def test_only_cpu_linears_of_packed_dtypes_within_the_size_limit_are_packed(monkeypatch):
    monkeypatch.setattr(packed, "dtypes", lambda: (torch.float32, torch.bfloat16))  # no kernel runs here
    assert packed.wins(tiny_model())  # float32
    assert not packed.wins(tiny_model(dtype=torch.float16))  # no packed float16 kernel here: left alone
    layer = nn.Linear(8, 4).to(torch.bfloat16)
    layer.bias.data = layer.bias.data.float()  # mixed weight and bias dtypes: left alone
    assert not packed.wins(layer)
    monkeypatch.setattr(packed, "dtypes", lambda: (torch.bfloat16,))  # a CPU that packs bf16 only
    assert not packed.wins(tiny_model())
    model = tiny_model(dtype=torch.bfloat16)
    assert packed.wins(model)
    monkeypatch.setattr(packed, "MAX_BYTES", 1000)
    assert not packed.wins(model)
    with packed_linears(model):
        assert not any("forward" in m.__dict__ for m in model.modules())


def _samples_with_and_without_packing(model, monkeypatch) -> list[list]:
    """The engine's samples of `model` (Bridge at width 2, nucleus sampling), packed and not: [packed, plain], each
    a flat list; checks that the packed weights served the run that asked for them, and only that one."""
    calls = []
    forward = packed._packed_forward
    monkeypatch.setattr(packed, "_packed_forward", lambda *a: calls.append(1) or forward(*a))
    torch.manual_seed(3)
    prompts = [torch.randint(7, 97, (n,)).tolist() for n in (3, 6, 5)]
    runs = []
    for pack in (True, False):
        cfg = SamplingConfig(n=4, width=2, max_new_tokens=12, temperature=0.8, top_p=0.9, seed=1, pack_weights=pack)
        runs.append([s for r in generate_ids(model, prompts, cfg, [2], 0) for s in r])
        assert bool(calls) == pack
        calls.clear()
    assert not any("forward" in m.__dict__ for m in model.modules())  # restored
    return runs


@needs_bf16
def test_engine_samples_the_same_with_and_without_packing(monkeypatch):
    """bfloat16: tokens and log-probs equal bit for bit."""
    model = randomize_blocks(bridgelm.add_bridge(tiny_model(dtype=torch.bfloat16)), std=0.2)
    packed_run, plain_run = _samples_with_and_without_packing(model, monkeypatch)
    assert [(s.token_ids, s.logprobs) for s in packed_run] == [(s.token_ids, s.logprobs) for s in plain_run]


@needs_fp32
def test_engine_in_float32_samples_the_same_tokens_with_and_without_packing(monkeypatch):
    """float32: the same tokens, log-probs equal to float32 rounding (oneDNN's kernel against ATen's)."""
    model = randomize_blocks(bridgelm.add_bridge(tiny_model()), std=0.2)
    packed_run, plain_run = _samples_with_and_without_packing(model, monkeypatch)
    assert [s.token_ids for s in packed_run] == [s.token_ids for s in plain_run]
    for a, b in zip(packed_run, plain_run):
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-5)
