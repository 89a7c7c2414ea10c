"""The C++ CPU elementwise kernels (RMSNorm + residual, SiLU-and-mul, the NeoX rotary embedding,
the greedy argmax) against ``kvpilot.kernels.reference`` and the torch path of the engine's layers.

The kernel builds on first use (under a minute the first time on a machine, cached after);
these tests need a C++ compiler, like the engine's default CPU path. RMSNorm and the rotary
embedding follow the PyTorch ops' order and rounding exactly, so their results are compared bit
for bit, float32 and bfloat16 alike; SiLU to an ulp (its ``exp`` is ATen's SLEEF one, but which
elements take the vector or the scalar ``exp`` follows ATen's loop only while that runs on one
thread).
"""

from __future__ import annotations

import logging
import os
import platform
import subprocess
import sys

import pytest
import torch
import transformers

from kvpilot.engine.layers.activation import SiluAndMul
from kvpilot.engine.layers.layernorm import GemmaRMSNorm, RMSNorm
from kvpilot.engine.layers.rotary_embedding import RotaryEmbedding, apply_rotary_emb
from kvpilot.kernels import reference
from kvpilot.kernels.cpu import elementwise, extension, prebuilt

pytestmark = pytest.mark.skipif(
    platform.machine() not in elementwise.MACHINES,
    reason="the kernels reproduce ATen's x86-64 summation order; other CPUs keep the torch path",
)

DTYPES = [torch.float32, torch.bfloat16]
# (rows, hidden): one row, a decode batch, odd sizes, SmolLM2's 576 and a head's 64.
NORM_SHAPES = [(1, 576), (32, 576), (32, 64), (5, 37), (3, 7), (7, 1), (2, 3072)]


@pytest.fixture(scope="module", autouse=True)
def built_kernel():
    assert elementwise.load_extension() is not None, "the CPU elementwise kernels did not build"


def _randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int, scale: float = 1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * scale).to(dtype)


def _close(got: torch.Tensor, want: torch.Tensor, exact: bool = True) -> None:
    """Equal bit for bit, or (``exact=False``: SiLU) within an ulp or two of the dtype."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if exact:
        torch.testing.assert_close(got, want, atol=0, rtol=0)
    elif want.dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    else:
        torch.testing.assert_close(got, want, atol=1e-2, rtol=8e-3)


@pytest.mark.parametrize("weight_offset", [0.0, 1.0], ids=["llama", "gemma"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, hidden", NORM_SHAPES)
def test_rms_norm_matches_the_reference(rows, hidden, dtype, weight_offset):
    x = _randn(rows, hidden, dtype=dtype, seed=0, scale=3.0)
    weight = _randn(hidden, dtype=dtype, seed=1)
    got = elementwise.rms_norm(x, weight, 1e-5, weight_offset=weight_offset)
    want = reference.rms_norm(x, weight, 1e-5, weight_offset=weight_offset)
    _close(got, want)


@pytest.mark.parametrize("weight_offset", [0.0, 1.0], ids=["llama", "gemma"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, hidden", NORM_SHAPES)
def test_rms_norm_with_residual_matches_the_reference(rows, hidden, dtype, weight_offset):
    x = _randn(rows, hidden, dtype=dtype, seed=2)
    residual = _randn(rows, hidden, dtype=dtype, seed=3, scale=4.0)
    weight = _randn(hidden, dtype=dtype, seed=4)
    x_before, residual_before = x.clone(), residual.clone()
    got, got_residual = elementwise.rms_norm(x, weight, 1e-6, residual, weight_offset)
    want, want_residual = reference.rms_norm(x, weight, 1e-6, residual, weight_offset=weight_offset)
    # The new residual stream is the sum rounded to the dtype, on both paths alike.
    torch.testing.assert_close(got_residual, want_residual, atol=0, rtol=0)
    _close(got, want)
    # Neither input is written: callers may still hold them (the first layer's residual is the
    # embedding output).
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


def test_rms_norm_keeps_leading_dimensions():
    x = _randn(2, 3, 64, seed=5)
    weight = _randn(64, seed=6)
    got = elementwise.rms_norm(x, weight, 1e-6)
    assert got.shape == (2, 3, 64)
    _close(got, reference.rms_norm(x, weight, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "shape", [(1, 2 * 1536), (32, 2 * 1536), (5, 2 * 41), (2, 3, 2 * 7), (4, 2)]
)
def test_silu_and_mul_matches_the_reference(shape, dtype):
    x = _randn(*shape, dtype=dtype, seed=7, scale=4.0)
    got = elementwise.silu_and_mul(x)
    assert got.shape == (*shape[:-1], shape[-1] // 2)
    _close(got, reference.silu_and_mul(x), exact=False)


def _cos_sin(num_tokens, rotary_dim, dtype, seed):
    positions = torch.randint(0, 4096, (num_tokens,), generator=torch.Generator().manual_seed(seed))
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    freqs = positions[:, None].float() * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "num_tokens, num_heads, num_kv_heads, head_dim, rotary_dim",
    [(1, 9, 3, 64, 64), (32, 9, 3, 64, 64), (5, 4, 1, 16, 12), (3, 2, 2, 10, 10)],
    ids=["smollm2-1", "smollm2-32", "partial", "odd-half"],
)
def test_rotary_matches_the_torch_path(
    num_tokens, num_heads, num_kv_heads, head_dim, rotary_dim, dtype
):
    # q and k as views of one fused QKV output, as the attention layer passes them.
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = _randn(num_tokens, width, dtype=dtype, seed=8)
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim]
    k = k.view(num_tokens, num_kv_heads, head_dim)
    cos, sin = _cos_sin(num_tokens, rotary_dim, dtype, seed=9)
    before = qkv.clone()
    got_q, got_k = elementwise.rotary_neox(q, k, cos, sin)
    _close(got_q, apply_rotary_emb(q, cos, sin))
    _close(got_k, apply_rotary_emb(k, cos, sin))
    assert torch.equal(qkv, before), "the inputs are not rotated in place"


def _rope_layer() -> RotaryEmbedding:
    config = transformers.LlamaConfig(
        hidden_size=576,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        max_position_embeddings=8192,
        rope_theta=100000.0,
    )
    return RotaryEmbedding(config, 64)


@pytest.mark.parametrize("dtype", DTYPES)
def test_layers_take_the_kernel_and_keep_the_torch_values(dtype, monkeypatch):
    calls = []
    for name in ("rms_norm", "silu_and_mul", "rotary_neox"):
        original = getattr(elementwise, name)

        def counted(*args, _original=original, _name=name, **kwargs):
            calls.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(elementwise, name, counted)
    x, residual = _randn(32, 576, dtype=dtype, seed=10), _randn(32, 576, dtype=dtype, seed=11)
    for norm_cls in (RMSNorm, GemmaRMSNorm):
        norm = norm_cls(576, 1e-5).to(dtype)
        norm.weight.data = _randn(576, dtype=dtype, seed=12)
        offset = norm_cls.weight_offset
        _close(norm(x), reference.rms_norm(x, norm.weight, 1e-5, weight_offset=offset))
        got, got_residual = norm(x, residual)
        want, want_residual = reference.rms_norm(
            x, norm.weight, 1e-5, residual, weight_offset=offset
        )
        _close(got, want)
        torch.testing.assert_close(got_residual, want_residual, atol=0, rtol=0)
    stacked = _randn(32, 2 * 1536, dtype=dtype, seed=13)
    _close(SiluAndMul()(stacked), reference.silu_and_mul(stacked), exact=False)
    rope = _rope_layer()
    positions = torch.arange(100, 132)
    prepared = rope.prepare(positions, dtype)
    q, k = _randn(32, 9, 64, dtype=dtype, seed=14), _randn(32, 3, 64, dtype=dtype, seed=15)
    got_q, got_k = rope(prepared, q, k)
    _close(got_q, apply_rotary_emb(q, prepared.cos, prepared.sin))
    _close(got_k, apply_rotary_emb(k, prepared.cos, prepared.sin))
    assert calls == ["rms_norm"] * 4 + ["silu_and_mul", "rotary_neox"]


def test_layers_fall_back_where_the_kernel_does_not_apply(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the kernel was called")

    for name in ("rms_norm", "silu_and_mul", "rotary_neox"):
        monkeypatch.setattr(elementwise, name, refuse)
    norm = RMSNorm(16, 1e-6)
    norm.weight.data = _randn(16, seed=16)
    # float16, a per-head view cut out of a fused output, a weight of another dtype.
    half = _randn(4, 16, dtype=torch.float16, seed=17)
    norm_half = RMSNorm(16, 1e-6).half()
    norm_half.weight.data = norm.weight.data.half()
    _close(norm_half(half), reference.rms_norm(half, norm_half.weight, 1e-6))
    view = _randn(3, 128, seed=18)[:, :64].view(3, 4, 16)
    _close(norm(view), reference.rms_norm(view, norm.weight, 1e-6))
    bf16 = _randn(4, 16, dtype=torch.bfloat16, seed=19)
    want = reference.rms_norm(bf16, norm.weight, 1e-6)
    assert norm(bf16).dtype == want.dtype == torch.float32  # the weight's dtype wins, as in torch
    with pytest.raises(RuntimeError, match="size of tensor"):  # odd: torch's own error
        SiluAndMul()(_randn(3, 9, seed=20))
    strided = _randn(3, 20, seed=21)[:, ::2]
    _close(SiluAndMul()(strided), reference.silu_and_mul(strided))
    rope = _rope_layer()
    prepared = rope.prepare(torch.arange(4), torch.float32)
    q = _randn(4, 64, 9, seed=22).transpose(1, 2)  # heads not contiguous
    k = _randn(4, 3, 64, seed=23)
    got_q, _ = rope(prepared, q, k)
    _close(got_q, apply_rotary_emb(q, prepared.cos, prepared.sin))
    # The switch, read when a layer is built.
    monkeypatch.setenv(elementwise.ENV_VAR, "0")
    assert not elementwise.enabled() and not RMSNorm(16, 1e-6).cpu_kernel
    off = RMSNorm(16, 1e-6)
    off.weight.data = norm.weight.data
    x = _randn(2, 16, seed=24)
    _close(off(x), reference.rms_norm(x, off.weight, 1e-6))


@pytest.mark.parametrize("n", [1, 7, 16, 17, 49152, 49155])
def test_argmax_matches_torch(n):
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(9, n, generator=gen)
    x[1] = x[1].round()  # ties: the first of the largest wins
    x[2] = float("-inf")  # all -inf: index 0
    x[3, n // 2] = float("nan")  # a NaN ranks above every number
    x[3, n - 1] = float("inf")
    x[4] = 0.0
    x[4, n - 1] = -0.0  # -0.0 == 0.0: still the first
    x[5, -1] = float("inf")  # the maximum in the scalar tail
    x[6, 0] = float("nan")
    x[6, -1] = float("nan")  # the first of two NaNs
    x[7] = -x[7].abs() - 1  # every value negative
    x[8, -1] = float("nan")  # a NaN in the tail
    torch.testing.assert_close(elementwise.argmax(x), x.argmax(dim=-1), atol=0, rtol=0)
    # Not contiguous: copied first.
    wide = torch.randn(3, 2 * n, generator=gen)[:, ::2]
    torch.testing.assert_close(elementwise.argmax(wide), wide.argmax(dim=-1), atol=0, rtol=0)


def test_greedy_sampling_takes_the_argmax_kernel(monkeypatch):
    from kvpilot.engine.sampler import greedy_argmax

    calls = []
    original = elementwise.argmax
    monkeypatch.setattr(elementwise, "argmax", lambda x: calls.append(x.shape) or original(x))
    logits = _randn(32, 49152, seed=40)
    torch.testing.assert_close(greedy_argmax(logits), logits.argmax(dim=-1), atol=0, rtol=0)
    assert calls == [(32, 49152)]
    # Other dtypes and no rows keep torch's argmax.
    half = logits.bfloat16()
    torch.testing.assert_close(greedy_argmax(half), half.argmax(dim=-1), atol=0, rtol=0)
    assert greedy_argmax(logits[:0]).shape == (0,)
    assert calls == [(32, 49152)]


def test_bad_inputs_are_named():
    x = _randn(4, 16, seed=25)
    with pytest.raises(RuntimeError, match="weight must be"):
        elementwise.rms_norm(x, _randn(15, seed=26), 1e-6)
    with pytest.raises(RuntimeError, match="share one dtype"):
        elementwise.rms_norm(x, _randn(16, seed=26).bfloat16(), 1e-6)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        elementwise.rms_norm(x.double(), _randn(16, seed=26).double(), 1e-6)
    with pytest.raises(RuntimeError, match="residual must be"):
        elementwise.rms_norm(x, _randn(16, seed=26), 1e-6, _randn(4, 8, seed=27))
    with pytest.raises(RuntimeError, match="contiguous"):
        elementwise.rms_norm(x.t(), _randn(4, seed=26), 1e-6)
    with pytest.raises(RuntimeError, match="must be even"):
        elementwise.silu_and_mul(_randn(3, 7, seed=28))
    with pytest.raises(RuntimeError, match="contiguous"):
        elementwise.silu_and_mul(_randn(3, 16, seed=28)[:, ::2])
    q, k = _randn(2, 4, 16, seed=29), _randn(2, 2, 16, seed=30)
    cos, sin = _cos_sin(2, 16, torch.float32, seed=31)
    with pytest.raises(RuntimeError, match="at most head_dim"):
        elementwise.rotary_neox(q, k, *_cos_sin(2, 32, torch.float32, seed=31))
    with pytest.raises(RuntimeError, match="cos and sin"):
        elementwise.rotary_neox(q, k, cos.bfloat16(), sin.bfloat16())
    with pytest.raises(RuntimeError, match=r"\[num_tokens, num_heads, head_dim\]"):
        elementwise.rotary_neox(q.flatten(1), k, cos, sin)
    with pytest.raises(RuntimeError, match="argmax: x must be"):
        elementwise.argmax(x.bfloat16())
    with pytest.raises(RuntimeError, match="argmax: x must be"):
        elementwise.argmax(x[:, :0])


def test_a_failed_build_warns_once_and_the_layers_keep_the_torch_path(
    monkeypatch, caplog, tmp_path
):
    from torch.utils import cpp_extension

    monkeypatch.setenv(prebuilt.ENV_VAR, str(tmp_path))  # empty: the build path is taken

    calls = []

    def failing_load(**kwargs):
        calls.append(kwargs["name"])
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(cpp_extension, "load", failing_load)
    elementwise.load_extension.cache_clear()
    try:
        norm = RMSNorm(64, 1e-6)
        norm.weight.data = _randn(64, seed=32)
        x = _randn(3, 64, seed=33)
        with caplog.at_level(logging.WARNING, logger="kvpilot.kernels"):
            assert not elementwise.available()
            _close(norm(x), reference.rms_norm(x, norm.weight, 1e-6))
            _close(SiluAndMul()(x), reference.silu_and_mul(x))
        assert calls == [elementwise.EXTENSION_NAME]
        warnings = [r for r in caplog.records if "elementwise kernels unavailable" in r.message]
        assert len(warnings) == 1 and "Ninja is required" in warnings[0].message
        with pytest.raises(RuntimeError, match="could not be built"):
            elementwise.silu_and_mul(x)
    finally:
        elementwise.load_extension.cache_clear()


def test_a_build_lock_left_by_a_killed_process_does_not_hang_the_next_load(tmp_path):
    # torch's lock file, as a process killed inside cpp_extension.load leaves it: the next
    # loader holds the kernel's flock, knows the file is stale, removes it and loads (from
    # torch's build cache: no prebuilt kernel here).
    folder = extension.build_folder(elementwise.EXTENSION_NAME)
    (folder / "lock").touch()
    code = "from kvpilot.kernels.cpu import elementwise as e; assert e.load_extension() is not None"
    env = {**os.environ, prebuilt.ENV_VAR: str(tmp_path)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=900)  # bounds a hang
    assert not (folder / "lock").exists()
