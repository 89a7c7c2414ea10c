"""``lora_shrink`` / ``lora_expand`` (Triton, interpreter on CPU) against their PyTorch references,
and the slot segmentation they share."""

from __future__ import annotations

import pytest
import torch

from kvpilot.kernels import lora_reference
from kvpilot.kernels.lora_expand import lora_expand
from kvpilot.kernels.lora_segments import lora_segments
from kvpilot.kernels.lora_shrink import lora_shrink
from tests.kernels.compile_check import assert_compiled_cleanly, compiled_launches

pytestmark = pytest.mark.kernel

NUM_SLOTS = 3


def _case(num_tokens: int, in_features: int, rank: int, out_features: int, dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, in_features, generator=g).to(dtype)
    lora_a = (torch.randn(NUM_SLOTS, rank, in_features, generator=g) * 0.1).to(dtype)
    lora_b = (torch.randn(NUM_SLOTS, out_features, rank, generator=g) * 0.1).to(dtype)
    # Mixed order, every slot and the base model (-1) present, slot 1 used most.
    slots = torch.randint(-1, NUM_SLOTS, (num_tokens,), generator=g, dtype=torch.int32)
    slots[:4] = torch.tensor([1, -1, 0, 2], dtype=torch.int32)
    y = torch.randn(num_tokens, out_features, generator=g).to(dtype)
    return x, lora_a, lora_b, slots, y


def test_segments_group_tokens_by_slot() -> None:
    slots = torch.tensor([2, -1, 0, 2, 2, -1, 0], dtype=torch.int32)
    seg = lora_segments(slots, num_slots=4)
    assert seg.token_indices.tolist() == [2, 6, 0, 3, 4, 1, 5]
    assert seg.slot_start.tolist() == [0, 2, 2, 5]
    assert seg.slot_num_tokens.tolist() == [2, 0, 3, 0]
    assert seg.max_tokens_per_slot == 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("num_tokens", "in_features", "rank", "out_features"),
    [
        (37, 72, 24, 40),  # nothing a multiple of a block: every mask matters
        (5, 130, 80, 136),  # rank above one 64-wide tile; in_features over two K steps
    ],
)
def test_shrink_expand_match_reference(num_tokens, in_features, rank, out_features, dtype) -> None:
    x, lora_a, lora_b, slots, y = _case(num_tokens, in_features, rank, out_features, dtype)
    shrunk = lora_shrink(x, lora_a, slots)
    expected = lora_reference.lora_shrink(x, lora_a, slots)
    assert shrunk.dtype == torch.float32
    torch.testing.assert_close(shrunk, expected, atol=1e-5, rtol=1e-5)
    assert shrunk[slots < 0].abs().max() == 0

    got, want = y.clone(), y.clone()
    lora_expand(shrunk, lora_b, slots, got)
    lora_reference.lora_expand(expected, lora_b, slots, want)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-3, "rtol": 2e-3}
    torch.testing.assert_close(got, want, **tol)
    base = slots < 0
    assert torch.equal(got[base], y[base])  # base-model rows untouched, bit for bit
    assert not torch.equal(got[~base], y[~base])


def test_reference_is_the_per_token_formula() -> None:
    x, lora_a, lora_b, slots, y = _case(9, 8, 4, 6, torch.float32, seed=1)
    out = y.clone()
    lora_reference.lora_expand(lora_reference.lora_shrink(x, lora_a, slots), lora_b, slots, out)
    for t in range(9):
        s = int(slots[t])
        want = y[t] if s < 0 else y[t] + x[t] @ lora_a[s].T @ lora_b[s].T
        torch.testing.assert_close(out[t], want, atol=1e-6, rtol=1e-6)


def test_all_base_tokens_is_a_no_op() -> None:
    x, lora_a, lora_b, _, y = _case(6, 16, 16, 16, torch.float32)
    slots = torch.full((6,), -1, dtype=torch.int32)
    shrunk = lora_shrink(x, lora_a, slots)
    assert shrunk.abs().max() == 0
    out = y.clone()
    lora_expand(shrunk, lora_b, slots, out)
    assert torch.equal(out, y)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda x, a, b, s, y: lora_shrink(x, a.half(), s), "lora_shrink: lora_a must have dtype"),
        (
            lambda x, a, b, s, y: lora_shrink(x, a[:, :, :8], s),
            "lora_shrink: lora_a must have shape",
        ),
        (
            lambda x, a, b, s, y: lora_shrink(x, a, s + 5),
            r"token_slots entries must lie in \[-1, 3\)",
        ),
        (lambda x, a, b, s, y: lora_shrink(x, a, s.float()), "token_slots must have dtype"),
        (lambda x, a, b, s, y: lora_expand(x, b, s, y), "lora_expand: lora_b must have shape"),
        (
            lambda x, a, b, s, y: lora_expand(x[:, :4], b, s, y.t()),
            "lora_expand: y must have shape",
        ),
    ],
)
def test_bad_input_is_named(call, message: str) -> None:
    x, lora_a, lora_b, slots, y = _case(6, 16, 4, 16, torch.float32)
    before = y.clone()
    with pytest.raises(ValueError, match=message):
        call(x, lora_a, lora_b, slots, y)
    assert torch.equal(y, before)


def test_model_with_kernels_matches_torch_path(tiny_llama_dir, tmp_path) -> None:
    """The whole LoRA layout (stacked q/k/v and gate/up slices, padded ranks, a base sequence)
    through the kernels gives the torch path's hidden states."""
    import peft
    import transformers

    from kvpilot.engine.attention import AttentionMetadata
    from kvpilot.engine.lora import LoRARequest
    from kvpilot.engine.lora.manager import LoRAManager
    from kvpilot.engine.model_loader import load_model

    targets = [["q_proj", "v_proj", "down_proj"], ["k_proj", "o_proj", "gate_proj", "up_proj"]]
    for i, target_modules in enumerate(targets):
        base = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
        model = peft.get_peft_model(
            base, peft.LoraConfig(r=4 * (i + 1), lora_alpha=8, target_modules=target_modules)
        )
        g = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_" in name:
                    param.copy_(torch.randn(param.shape, generator=g) * 0.2)
        model.save_pretrained(tmp_path / f"a{i}")

    def hidden(use_kernels: bool, names: list[str | None]) -> torch.Tensor:
        model = load_model(tiny_llama_dir, dtype=torch.float32, device="cpu")
        manager = LoRAManager(model, max_loras=2, max_lora_rank=16, use_kernels=use_kernels)
        for i in range(2):
            manager.add_adapter(LoRARequest(f"a{i}", i + 1, str(tmp_path / f"a{i}")))
        lens = [5, 3, 6]
        manager.set_batch(names, lens)
        shape = (6, 4, model.num_kv_heads, model.head_dim)
        caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(model.num_layers)]
        metadata = AttentionMetadata(
            slot_mapping=torch.tensor([*range(0, 5), *range(8, 11), *range(16, 22)]),
            query_start_loc=torch.tensor([0, 5, 8, 14], dtype=torch.int32),
            seq_lens=torch.tensor(lens, dtype=torch.int32),
            block_tables=torch.tensor([[0, 1], [2, 0], [4, 5]], dtype=torch.int32),
            max_query_len=6,
            max_seq_len=6,
        )
        ids = torch.tensor([5, 17, 300, 41, 9, 8, 8, 19, 4000, 3, 52, 610, 2, 91])
        positions = torch.tensor([0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3, 4, 5])
        with torch.no_grad():
            return model(ids, positions, caches, metadata)

    names = ["a1", None, "a0"]
    with_kernels = hidden(True, names)
    torch.testing.assert_close(with_kernels, hidden(False, names), atol=1e-5, rtol=1e-5)
    # The adapters' tokens changed, the base sequence's did not.
    base = hidden(False, [None, None, None])
    assert torch.equal(with_kernels[5:8], base[5:8])
    assert (with_kernels[:5] - base[:5]).abs().max() > 1e-2
    assert (with_kernels[8:] - base[8:]).abs().max() > 1e-2


@pytest.mark.parametrize("capability", [90, 80])
def test_launches_compile_for_gpus(capability: int) -> None:
    """The interpreter never compiles: this catches tl.dot shapes, shared memory overruns and
    register spills of the real launch configurations, without a GPU."""
    results = compiled_launches("lora_gpu_compile.py", capability)
    assert {r["kernel"] for r in results} == {"_lora_shrink_kernel", "_lora_expand_kernel"}
    assert len(results) == 8
    assert_compiled_cleanly(results, capability)
