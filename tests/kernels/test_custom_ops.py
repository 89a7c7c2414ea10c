"""The engine's layers on the Triton path (interpreter on CPU) against their torch path: RMSNorm
and GemmaRMSNorm with and without the fused residual add, SiluAndMul, GeluAndMul (exact and
tanh), RotaryEmbedding (plain and rope-scaled), and whole Qwen3 (q/k norms included), Granite,
Phi-3 and Gemma forward passes in which every layer op launches its Triton kernel."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import pytest
import torch
import transformers
import triton

from kvpilot.engine.attention import AttentionMetadata
from kvpilot.engine.layers.activation import GeluAndMul, SiluAndMul
from kvpilot.engine.layers.custom_op import CustomOp
from kvpilot.engine.layers.layernorm import GemmaRMSNorm, RMSNorm
from kvpilot.engine.layers.rotary_embedding import RotaryEmbedding
from kvpilot.engine.model_loader import load_model
from kvpilot.engine.model_runner import allocate_kv_caches
from kvpilot.kernels import activation, rms_norm, rotary_embedding

pytestmark = pytest.mark.kernel

BACKENDS = ("torch", "triton")


def _randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _tolerance(dtype: torch.dtype) -> dict[str, float]:
    return {"atol": 1e-6, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-3, "rtol": 2e-3}


def _rope_config(**rope: object) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        rope_theta=500000.0,
        rope_scaling=rope or None,
    )


@pytest.mark.parametrize("norm_cls", [RMSNorm, GemmaRMSNorm])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_paths_agree(dtype: torch.dtype, with_residual: bool, norm_cls: type) -> None:
    norms = {name: norm_cls(72, 1e-5, name) for name in BACKENDS}
    weight = _randn(72, seed=1).to(dtype)
    for norm in norms.values():
        norm.weight.data = weight
    x = _randn(5, 72, dtype=dtype, seed=0)
    residual = _randn(5, 72, dtype=dtype, seed=2) if with_residual else None
    args = (x,) if residual is None else (x, residual)
    got, want = norms["triton"](*args), norms["torch"](*args)
    if with_residual:
        (got, got_residual), (want, want_residual) = got, want
        # The new residual stream is the plain sum, rounded to the dtype on both paths.
        torch.testing.assert_close(got_residual, x + residual, atol=0, rtol=0)
        torch.testing.assert_close(want_residual, x + residual, atol=0, rtol=0)
    assert got.dtype == want.dtype == dtype
    torch.testing.assert_close(got, want, **_tolerance(dtype))


def test_rms_norm_per_head_view() -> None:
    # Qwen3's q_norm: [num_tokens, num_heads, head_dim] viewed out of a fused QKV output.
    qkv = _randn(3, 128, seed=3)
    q = qkv[:, :64].view(3, 4, 16)
    weight = _randn(16, seed=4)
    outs = {}
    for name in BACKENDS:
        norm = RMSNorm(16, 1e-6, name)
        norm.weight.data = weight
        outs[name] = norm(q)
    assert outs["triton"].shape == (3, 4, 16)
    torch.testing.assert_close(outs["triton"], outs["torch"], atol=1e-6, rtol=1e-5)


ACT_AND_MULS = {
    "silu": SiluAndMul,
    "gelu": lambda backend: GeluAndMul("none", backend),
    "gelu_tanh": lambda backend: GeluAndMul("tanh", backend),  # Gemma's
}


@pytest.mark.parametrize("act", list(ACT_AND_MULS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_act_and_mul_paths_agree(dtype: torch.dtype, act: str) -> None:
    x = _randn(2, 3, 2 * 41, dtype=dtype, seed=5).mul(4)
    got, want = ACT_AND_MULS[act]("triton")(x), ACT_AND_MULS[act]("torch")(x)
    assert got.shape == want.shape == (2, 3, 41)
    assert got.dtype == want.dtype == dtype
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else _tolerance(dtype)
    torch.testing.assert_close(got, want, **tol)


ROPE_SCALINGS = {
    "default": {},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    # YaRN scales cos and sin by its attention factor (0.1 * ln(factor) + 1).
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512},
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("scaling", list(ROPE_SCALINGS))
def test_rotary_paths_agree(dtype: torch.dtype, scaling: str) -> None:
    config = _rope_config(**ROPE_SCALINGS[scaling])
    ropes = {name: RotaryEmbedding(config, 16, name) for name in BACKENDS}
    if scaling == "yarn":
        assert ropes["torch"].attention_scaling > 1.0
    # q and k as views of one [num_tokens, (4 + 2 + 2) * 16] projection output; positions past
    # llama3's original context, where its frequencies are rescaled.
    qkv = _randn(5, 8 * 16, dtype=dtype, seed=6)
    positions = torch.tensor([0, 1, 63, 700, 2047])
    outs = {}
    for name, rope in ropes.items():
        fused = qkv.clone()
        q, k = fused[:, :64].view(5, 4, 16), fused[:, 64:96].view(5, 2, 16)
        outs[name] = rope(rope.prepare(positions, dtype), q, k)
        if name == "triton":
            assert outs[name][0].data_ptr() == q.data_ptr()  # rotated in place
            torch.testing.assert_close(fused[:, 96:], qkv[:, 96:], atol=0, rtol=0)  # V as is
    assert not torch.equal(outs["torch"][0], qkv[:, :64].view(5, 4, 16))
    for got, want in zip(outs["triton"], outs["torch"], strict=True):
        torch.testing.assert_close(got, want, **_tolerance(dtype))


def test_cos_sin_cache_holds_the_torch_paths_values() -> None:
    rope = RotaryEmbedding(_rope_config(**ROPE_SCALINGS["yarn"]), 16, "triton")
    assert rope._cos_sin_cache is None  # built on first use
    positions = torch.tensor([0, 5, 2047])
    cos, sin = rope.cos_sin(positions, torch.float32)
    half = rope.inv_freq.shape[0]
    cache = rope.cos_sin_cache
    assert cache.shape == (2048, 2 * half) and cache.dtype == torch.float32
    torch.testing.assert_close(cache[positions, :half], cos[:, 0, :half], atol=0, rtol=0)
    torch.testing.assert_close(cache[positions, half:], sin[:, 0, :half], atol=0, rtol=0)
    assert rope.cos_sin_cache is cache  # kept


def test_position_past_the_cache_is_refused() -> None:
    rope = RotaryEmbedding(_rope_config(), 16, "triton")
    q, k = torch.zeros(1, 4, 16), torch.zeros(1, 2, 16)
    positions = torch.tensor([2048])
    with pytest.raises(ValueError, match=r"positions entries must lie in \[0, 2048\)"):
        rope(rope.prepare(positions, torch.float32), q, k)


def test_unknown_kernel_backend_is_named() -> None:
    with pytest.raises(ValueError, match="unknown kernel backend 'cuda'; available: torch, triton"):
        SiluAndMul("cuda")


def _kernel_backends(model: torch.nn.Module) -> set[str]:
    return {m.kernel_backend for m in model.modules() if isinstance(m, CustomOp)}


class _CountingKernel:
    """Stands in for a Triton kernel: ``kernel[grid](...)`` appends its name to ``launches``,
    then launches it."""

    def __init__(self, kernel: triton.runtime.jit.KernelInterface, name: str, launches: list):
        self.kernel, self.name, self.launches = kernel, name, launches

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
        def launch(*args: object, **kwargs: object) -> None:
            self.launches.append(self.name)
            self.kernel[grid](*args, **kwargs)

        return launch


def _record_layer_kernel_launches(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the layer kernels (norm, activation, rotary) launched from now on."""
    launches: list[str] = []
    for module in (activation, rms_norm, rotary_embedding):
        for name, kernel in list(vars(module).items()):
            # Launched kernels only: jit helpers are called from inside them.
            if name.endswith("_kernel") and isinstance(kernel, triton.runtime.jit.KernelInterface):
                monkeypatch.setattr(module, name, _CountingKernel(kernel, name, launches))
    return launches


def _op_implementations(model: torch.nn.Module, launches: list[str]) -> dict[str, set[str]]:
    """Hook every layer op of ``model``; the returned dict fills in, per op class, with
    ``"triton"`` for each call that launched a Triton kernel and ``"torch"`` for one that did
    not."""
    ran: dict[str, set[str]] = defaultdict(set)
    before: dict[int, int] = {}

    def pre_hook(op: torch.nn.Module, args: object) -> None:
        before[id(op)] = len(launches)

    def post_hook(op: torch.nn.Module, args: object, output: object) -> None:
        ran[type(op).__name__].add("triton" if len(launches) > before[id(op)] else "torch")

    for op in model.modules():
        if isinstance(op, CustomOp):
            op.register_forward_pre_hook(pre_hook)
            op.register_forward_hook(post_hook)
    return ran


@pytest.mark.parametrize(
    ("architecture", "overrides", "ops"),
    [
        ("qwen3", {}, {"RMSNorm", "SiluAndMul", "RotaryEmbedding"}),
        # The attention kernel with Granite's scale; the rotary kernel on 3/4 of each head.
        (
            "granite",
            {"attention_multiplier": 0.15, "residual_multiplier": 0.5},
            {"RMSNorm", "SiluAndMul", "RotaryEmbedding"},
        ),
        ("phi3", {"partial_rotary_factor": 0.75}, {"RMSNorm", "SiluAndMul", "RotaryEmbedding"}),
        # Gemma's (1 + weight) norm and tanh GeGLU: rms_norm's weight offset, gelu_and_mul.
        ("gemma", {"head_dim": 32}, {"GemmaRMSNorm", "GeluAndMul", "RotaryEmbedding"}),
    ],
)
def test_forward_paths_agree(
    tiny_model_dir: Callable,
    monkeypatch: pytest.MonkeyPatch,
    architecture: str,
    overrides: dict,
    ops: set[str],
) -> None:
    # One 6-token prefill and a 3-token chunk over 9 cached tokens, in one batch: the Triton
    # model runs every layer kernel (q/k norms, fused residual norms, rotary, the gated
    # activation) and the attention kernels; every layer op reports launching its kernel.
    folder = tiny_model_dir(architecture, **overrides)
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor([0, 1, 2, 3, 4, 5, 17, 18, 19]),
        query_start_loc=torch.tensor([0, 6, 9], dtype=torch.int32),
        seq_lens=torch.tensor([6, 12], dtype=torch.int32),
        block_tables=torch.tensor([[0, 3], [1, 2]], dtype=torch.int32),
        max_query_len=6,
        max_seq_len=12,
    )
    input_ids = torch.randint(3, 49152, (9,), generator=torch.Generator().manual_seed(7))
    positions = torch.tensor([0, 1, 2, 3, 4, 5, 9, 10, 11])
    launches = _record_layer_kernel_launches(monkeypatch)
    hidden = {}
    for name in BACKENDS:
        model = load_model(folder, torch.float32, "cpu", attention_backend=name)
        # [num_blocks, k/v, block_size, kv_heads, head_dim]
        cached = _randn(4, 2, 8, model.num_kv_heads, model.head_dim, seed=8)
        assert _kernel_backends(model) == {name}
        # Checkpoint norms are ones (Gemma's zeros): perturb them so `1 + weight` matters.
        norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
        for seed, norm in enumerate(norms):
            norm.weight.data += 0.1 * _randn(*norm.weight.shape, seed=100 + seed)
        implementations = _op_implementations(model, launches)
        kv_caches = allocate_kv_caches(model, 4, 8, torch.device("cpu"))
        for k_cache, v_cache in kv_caches:
            k_cache.copy_(cached[:, 0])
            v_cache.copy_(cached[:, 1])
        with torch.inference_mode():
            hidden[name] = model(input_ids, positions, kv_caches, metadata)
        assert implementations == {op: {name} for op in ops}
    torch.testing.assert_close(hidden["triton"], hidden["torch"], atol=1e-5, rtol=1e-5)
