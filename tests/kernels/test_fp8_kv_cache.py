"""The fp8 KV cache in the Triton kernels (interpreter on CPU): ``reshape_and_cache`` stores
exactly what PyTorch's cast stores, ``unified_attention`` dequantizes exactly as the reference
does, and attention over the fp8 cache stays within a stated tolerance of float32 attention."""

from __future__ import annotations

import pathlib

import pytest
import torch

from kvpilot.engine import LLM, SamplingParams
from kvpilot.kernels import reference
from kvpilot.kernels.reshape_and_cache import reshape_and_cache
from kvpilot.kernels.testing import paged_batch
from kvpilot.kernels.unified_attention import unified_attention

pytestmark = pytest.mark.kernel

FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
# Attention over an fp8 cache against float32 attention over the unquantized cache, N(0, 1)
# keys and values. Rounding to 3 (E4M3) or 2 (E5M2) mantissa bits moves a value by at most
# 2**-4 (2**-3) of itself, and an output row is a convex combination of values: no element may
# move by more than max|v| * 2**-4 (2**-3), the stated bound on each element (the keys' rounding
# moves the weights by less here). Over all elements the root-mean-square error must stay
# under 0.025 (0.05); measured: 0.010-0.017 (0.018-0.035), largest single errors 0.14 (0.18).
FP8_ELEMENT_BOUND = {torch.float8_e4m3fn: 2.0**-4, torch.float8_e5m2: 2.0**-3}
FP8_RMS_TOL = {torch.float8_e4m3fn: 0.025, torch.float8_e5m2: 0.05}


def _fp8_values(dtype: torch.dtype) -> torch.Tensor:
    """Every finite value of ``dtype``, the midpoints between neighbours (ties to even), values
    past its largest (saturation) and random ones, as float32."""
    every = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    every = every[torch.isfinite(every)].sort().values
    mids = (every[1:] + every[:-1]) / 2
    big = torch.finfo(dtype).max
    extra = torch.tensor([big * 1.01, -big * 4, 1e30, -0.0])
    rand = torch.randn(512, generator=torch.Generator().manual_seed(0)) * 50
    return torch.cat([every, mids, extra, rand])


@pytest.mark.parametrize("src_dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("fmt", list(FP8))
def test_reshape_and_cache_stores_what_torch_stores(fmt: str, src_dtype: torch.dtype) -> None:
    dtype = FP8[fmt]
    k_scale, v_scale = torch.tensor(0.25), torch.tensor(3.0)
    values = _fp8_values(dtype)
    heads, dim = 2, 16
    num_tokens = -(-len(values) // (heads * dim))
    flat = torch.zeros(num_tokens * heads * dim)
    flat[: len(values)] = values
    key = (flat * k_scale).reshape(num_tokens, heads, dim).to(src_dtype)
    value = (flat.flip(0) * v_scale).reshape(num_tokens, heads, dim).to(src_dtype)
    block_size = 8
    num_blocks = -(-num_tokens // block_size) + 1
    slots = torch.randperm(num_blocks * block_size, generator=torch.Generator().manual_seed(1))
    slots = slots[:num_tokens]
    slots[3] = -1  # a padding token is skipped
    shape = (num_blocks, block_size, heads, dim)
    k_cache, v_cache = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    k_want, v_want = k_cache.clone(), v_cache.clone()
    reference.reshape_and_cache(key, value, k_want, v_want, slots, k_scale, v_scale)
    reshape_and_cache(key, value, k_cache, v_cache, slots, k_scale, v_scale)
    assert torch.equal(k_cache.view(torch.uint8), k_want.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), v_want.view(torch.uint8))
    # The reference is PyTorch's own saturating cast of x / scale: what it stores reads back
    # within half a step of x (relative for normals, absolute for subnormals).
    stored = k_cache.view(-1, heads, dim)[slots[slots >= 0]].float() * k_scale
    exact = key[slots >= 0].float()
    info, mantissa = torch.finfo(dtype), 3 if dtype == torch.float8_e4m3fn else 2
    bound = torch.maximum(
        exact.abs() * 2.0 ** -(mantissa + 1),
        torch.tensor(info.smallest_normal * 2.0 ** -(mantissa + 1) * float(k_scale)),
    )
    in_range = exact.abs() <= info.max * k_scale
    assert (stored - exact)[in_range].abs().le(bound[in_range]).all()
    assert (stored[~in_range].abs() == info.max * k_scale).all()


# name -> (specs, num_heads, num_kv_heads, head_dim, block_size): decode on block boundaries,
# a chunked prefill over cached context and a whole prompt, GQA 3 (SmolLM2's ratio).
CASES = {
    "decode": ([(1, 16), (1, 17), (1, 40)], 4, 2, 16, 8),
    "mixed-chunked": ([(1, 40), (5, 21), (17, 17), (0, 9)], 6, 2, 16, 8),
}


@pytest.mark.parametrize("num_kv_splits", [1, 3])
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("fmt", list(FP8))
@pytest.mark.parametrize("case", list(CASES))
def test_attention_over_fp8_cache(
    case: str, fmt: str, q_dtype: torch.dtype, num_kv_splits: int
) -> None:
    dtype = FP8[fmt]
    specs, num_heads, num_kv_heads, head_dim, block_size = CASES[case]
    batch = paged_batch(
        specs, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        block_size=block_size, dtype=torch.float32, generator=torch.Generator().manual_seed(2),
        spare_blocks=1,
    )  # fmt: skip
    # Scales that put the largest |k| at 200 and |v| at 100, vLLM's calculated scales.
    k_scale = batch.k_cache.abs().amax() / 200
    v_scale = batch.v_cache.abs().amax() / 100
    k8 = reference.quantize_to_cache(batch.k_cache, k_scale, dtype)
    v8 = reference.quantize_to_cache(batch.v_cache, v_scale, dtype)
    q = batch.q.to(q_dtype)
    kwargs = batch.attention_kwargs()
    got = unified_attention(
        q, k8, v8, k_scale=k_scale, v_scale=v_scale, num_kv_splits=num_kv_splits, **kwargs
    )
    assert got.dtype == q_dtype and got.shape == q.shape
    # The same dequantized cache through the reference: only the kernel's own rounding.
    want = reference.unified_attention(q, k8, v8, k_scale=k_scale, v_scale=v_scale, **kwargs)
    tol = 1e-5 if q_dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    # Against float32 attention over the unquantized cache: the stated fp8 tolerance.
    exact = reference.unified_attention(batch.q, batch.k_cache, batch.v_cache, **kwargs)
    error = (got.float() - exact).abs()
    assert error.max() <= batch.v_cache.abs().max() * FP8_ELEMENT_BOUND[dtype]
    assert error.pow(2).mean().sqrt() <= FP8_RMS_TOL[dtype]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"k_scale": None}, "needs k_scale"),
        ({"v_scale": torch.tensor(1.0, dtype=torch.float64)}, "v_scale must have dtype"),
        ({"k_scale": torch.ones(2)}, "k_scale must hold one value"),
        ({"v_cache": torch.zeros(2, 4, 2, 16, dtype=torch.float8_e5m2)}, "v_cache must have"),
    ],
)
def test_fp8_bad_input_names_argument(kwargs: dict, message: str) -> None:
    cache = torch.zeros(2, 4, 2, 16, dtype=torch.float8_e4m3fn)
    args = {
        "key": torch.zeros(2, 2, 16),
        "value": torch.zeros(2, 2, 16),
        "k_cache": cache,
        "v_cache": cache.clone(),
        "slot_mapping": torch.tensor([0, 1]),
        "k_scale": torch.tensor(1.0),
        "v_scale": torch.tensor(1.0),
    }
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        reshape_and_cache(**args)
    attention = {
        "query_start_loc": torch.tensor([0, 2], dtype=torch.int32),
        "seq_lens": torch.tensor([2], dtype=torch.int32),
        "block_tables": torch.tensor([[0]], dtype=torch.int32),
        "scale": 0.25,
        "k_scale": args["k_scale"],
        "v_scale": args["v_scale"],
    }
    with pytest.raises(ValueError, match=message):
        unified_attention(torch.zeros(2, 4, 16), args["k_cache"], args["v_cache"], **attention)


def test_engine_fp8_tokens_match_torch_backend(tiny_llama_dir: pathlib.Path) -> None:
    # Chunked prompts beside decodes (a budget of 16), calculated scales: both backends
    # quantize and attend alike (their norm and rotary kernels differ in the last float32
    # bits, hence the approximate scales), so greedy tokens and their logprobs agree.
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in (1, 17, 30)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    tokens, logprobs, scales = {}, {}, {}
    for backend in ("torch", "triton"):
        llm = LLM(
            str(tiny_llama_dir), attention_backend=backend, kv_cache_dtype="fp8",
            calculate_kv_scales=True, max_model_len=64, block_size=8, max_num_batched_tokens=16,
        )  # fmt: skip
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        runner = llm.llm_engine.model_runner
        assert {k.dtype for pair in runner.kv_caches for k in pair} == {torch.float8_e4m3fn}
        attn = runner.model.model.layers[0].self_attn.attn
        scales[backend] = (float(attn.k_scale), float(attn.v_scale))
        tokens[backend] = [list(o.outputs[0].token_ids) for o in outputs]
        logprobs[backend] = [o.outputs[0].cumulative_logprob for o in outputs]
    assert scales["triton"] == pytest.approx(scales["torch"], rel=1e-5)
    assert scales["torch"] != pytest.approx((1.0, 1.0))
    assert tokens["triton"] == tokens["torch"]
    assert logprobs["triton"] == pytest.approx(logprobs["torch"], abs=1e-4)
