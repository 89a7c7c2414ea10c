"""The planner on public MoE, quantized and multi-node models, against sizes worked out by hand.

The memory model is test_planner.py's (operator/planner.py's docstring):

    budget   = total memory * gpu_memory_utilization   (H100 81,559 MiB * 0.90; L4 23,034 * 0.86)
    weights  = this rank's parameters, linear layers in the checkpoint's quantized format
    reserve  = batched tokens * (3 * expert width/tp * experts per token + 4 * hidden) * 2
               + max_num_seqs * vocab * 4 + 1 GiB       (8192 tokens, 256 sequences on a GPU)
    blocks   = (budget - weights - reserve) // (kv bytes per token * 16)
    tokens   = blocks * 16; concurrency = blocks // (maxModelLen / 16)

Where the configs come from (tests/operator/configs/, the public config.json values):
- Mixtral-8x7B-v0.1.json: mistralai/Mixtral-8x7B-v0.1 (already used by test_model_spec.py).
- Qwen3-30B-A3B.json: Qwen/Qwen3-30B-A3B: 48 layers, hidden 2048, 32 query / 4 KV heads of 128,
  128 experts of width 768, 8 per token, vocab 151,936, untied, 40,960 positions (the sizes
  cross-checked against a public Megatron recipe, zyzshishui/slime scripts/models/qwen3-30B-A3B.sh).
- Meta-Llama-3.1-70B-Instruct-FP8.json: neuralmagic (now RedHatAI) Meta-Llama-3.1-70B-Instruct-FP8:
  the Llama-3.1-70B config with a compressed-tensors quantization_config, FP8 weights and static
  activations with one scale per tensor (its model card: "symmetric per-tensor quantization"),
  lm_head ignored. Written from the public config as remembered; the sizes read here (the FP8
  scheme, the ignore list, the Llama sizes) are the model card's.
- Meta-Llama-3-8B-Instruct-AWQ.json: an AutoAWQ export of Meta-Llama-3-8B-Instruct (as
  casperhansen/llama-3-8b-instruct-awq): bits 4, group_size 128, zero_point, version gemm,
  torch_dtype float16.
- Meta-Llama-3.1-405B.json: meta-llama/Llama-3.1-405B: 126 layers, hidden 16,384, 128 query / 8
  KV heads, MLP 53,248, vocab 128,256, 131,072 positions (llama3 rope scaling).
- Qwen2.5-72B-Instruct-AWQ-unpadded.json: Qwen2.5-72B-Instruct's config with an AutoAWQ
  quantization_config (bits 4, group_size 128, zero_point, gemm) and its own intermediate size
  29,568, as a user's own AWQ export has it (Qwen's published AWQ checkpoint pads it to 29,696
  so that it splits at TP 2 and 4).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from kvpilot.engine.model_shape import ModelShape
from kvpilot.operator.gpus import CATALOGUE, GiB, MiB, gpu_type
from kvpilot.operator.planner import PlanError, plan, plan_for_spec
from kvpilot.operator.spec import parse_spec

CONFIGS = Path(__file__).parent / "configs"
H100 = CATALOGUE["H100-80GB"]
L4 = CATALOGUE["L4"]
H100_BUDGET = int(81_559 * MiB * 0.90)
L4_BUDGET = int(23_034 * MiB * 0.86)
LOGITS = 256 * 4  # per vocabulary row: 256 sequences of float32 logits


def shape(name: str) -> ModelShape:
    return ModelShape.from_hf_config(json.loads((CONFIGS / f"{name}.json").read_text()))


def blocks(budget: int, weights: int, reserve: int, kv_per_token: int) -> int:
    return (budget - weights - reserve) // (kv_per_token * 16)


# ---- Mixtral-8x7B: 46.7B parameters, 12.9B active; 32 layers, 8 KV heads, 32,768 positions ----


def mixtral_weights(tp: int) -> int:
    """bf16 bytes per rank: q,o 4096 x 4096/tp, k,v 4096 x 1024/tp, 8 experts x 3 x 4096 x
    14336/tp, router 8 x 4096 and norms 2 x 4096 replicated, per layer; embeddings and LM head
    32000/tp rows each; final norm."""
    layer = 2 * 4096 * 4096 // tp + 2 * 4096 * 1024 // tp + 8 * 3 * 4096 * 14336 // tp
    layer += 8 * 4096 + 2 * 4096
    return 2 * (32 * layer + 2 * (32000 // tp) * 4096 + 4096)


@pytest.mark.parametrize(
    ("gpu", "budget", "tp", "expected_blocks", "concurrency"),
    [
        # TP 1: 93.4 GB of weights > the 77.0 GB budget. TP 2 holds 13 contexts.
        (H100, H100_BUDGET, 2, 26_879, 13),
        # TP 4 on L4: 23.4 GB per rank > the 20.8 GB budget; TP 8: 11.7 GB.
        (L4, L4_BUDGET, 8, 28_771, 14),
    ],
)
def test_mixtral_8x7b(gpu, budget, tp, expected_blocks, concurrency):
    model = shape("Mixtral-8x7B-v0.1")
    assert (model.num_parameters(), model.num_active_parameters()) == (
        46_702_792_704,
        # Active: attention 41,943,040 + 2 of 8 experts 352,321,536 + router and norms 40,960
        # = 394,305,536 per layer x 32, embeddings 2 x 32000 x 4096, final norm.
        32 * 394_305_536 + 2 * 32000 * 4096 + 4096,
    )
    p = plan(model, gpu=gpu)
    reserve = 8192 * (3 * 14336 // tp * 2 + 4 * 4096) * 2 + 32000 * LOGITS + GiB
    kv = 2 * 32 * (8 // tp if tp <= 8 else 1) * 128 * 2
    assert blocks(budget, mixtral_weights(tp), reserve, kv) == expected_blocks
    assert (p.tensor_parallel_size, p.pipeline_parallel_size, p.max_model_len) == (tp, 1, 32768)
    assert (p.weight_bytes_per_gpu, p.reserve_bytes_per_gpu) == (mixtral_weights(tp), reserve)
    assert (p.kv_bytes_per_token, p.kv_capacity_tokens) == (kv, expected_blocks * 16)
    assert p.max_concurrency == expected_blocks // (32768 // 16) == concurrency
    status = p.to_status()
    assert (status["numParameters"], status["numActiveParameters"]) == (
        46_702_792_704,
        12_879_925_248,
    )


# ---- Qwen3-30B-A3B: 128 experts of width 768, 8 per token, no shared expert ----


def qwen3_moe_weights(tp: int) -> int:
    """bf16 bytes per rank: q 2048 x 4096/tp, k,v 2048 x 512/tp, o 4096/tp x 2048, q/k norms 2 x
    128, 128 experts x 3 x 2048 x 768/tp, router 128 x 2048, norms 2 x 2048, per layer;
    embeddings and LM head 151936/tp rows each; final norm."""
    layer = 2048 * 4096 // tp + 2 * 2048 * 512 // tp + 4096 // tp * 2048 + 2 * 128
    layer += 128 * 3 * 2048 * 768 // tp + 128 * 2048 + 2 * 2048
    return 2 * (48 * layer + 2 * (151936 // tp) * 2048 + 2048)


@pytest.mark.parametrize(
    ("gpu", "budget", "tp", "kv_cache_dtype", "expected_blocks", "concurrency"),
    [
        # 56.9 GiB of weights fit one H100; 3 contexts of 40,960 tokens, 7 with a fp8 cache.
        (H100, H100_BUDGET, 1, "auto", 9052, 3),
        (H100, H100_BUDGET, 1, "fp8", 18_105, 7),
        # TP 2 on L4 (28.4 GiB per rank) does not fit the 19.3 GiB budget; TP 4 does.
        (L4, L4_BUDGET, 4, "auto", 10_292, 4),
        (L4, L4_BUDGET, 4, "fp8", 20_585, 8),
    ],
)
def test_qwen3_30b_a3b(gpu, budget, tp, kv_cache_dtype, expected_blocks, concurrency):
    model = shape("Qwen3-30B-A3B")
    assert (model.num_parameters(), model.num_active_parameters()) == (
        30_532_122_624,
        # Active: attention 18,874,624 + norms, 8 of 128 experts 37,748,736, router 262,144.
        48 * (2048 * 4096 * 2 + 2048 * 512 * 2 + 256 + 8 * 3 * 2048 * 768 + 128 * 2048 + 4096)
        + 2 * 151936 * 2048
        + 2048,
    )
    p = plan(model, gpu=gpu, kv_cache_dtype=kv_cache_dtype)
    reserve = 8192 * (3 * (768 // tp) * 8 + 4 * 2048) * 2 + 151936 * LOGITS + GiB
    kv_bytes = 1 if kv_cache_dtype == "fp8" else 2
    kv = 2 * 48 * (4 // tp) * 128 * kv_bytes
    assert blocks(budget, qwen3_moe_weights(tp), reserve, kv) == expected_blocks
    assert (p.tensor_parallel_size, p.max_model_len, p.kv_cache_dtype) == (
        tp,
        40960,
        kv_cache_dtype,
    )
    assert (p.weight_bytes_per_gpu, p.reserve_bytes_per_gpu) == (qwen3_moe_weights(tp), reserve)
    assert (p.kv_bytes_per_token, p.kv_capacity_tokens) == (kv, expected_blocks * 16)
    assert p.max_concurrency == expected_blocks // (40960 // 16) == concurrency


# ---- Llama-3.1-70B-Instruct FP8 (compressed-tensors, per-tensor) ----


def fp8_70b_weights(tp: int) -> int:
    """Per rank: every decoder linear 1 byte per weight plus a bf16 weight scale and a float32
    input scale (4 + 2 bytes) per tensor; embeddings, LM head (ignored) and norms bf16.
    Per layer: q,o 8192 x 8192/tp, k,v 8192 x 1024/tp, gate,up,down 8192 x 28672/tp."""
    linears = 2 * 8192 * 8192 // tp + 2 * 8192 * 1024 // tp + 3 * 8192 * 28672 // tp
    layer = linears + 7 * (2 + 4) + 2 * 8192 * 2
    return 80 * layer + 2 * (2 * (128256 // tp) * 8192 + 8192)


@pytest.mark.parametrize(
    ("gpu", "budget", "tp", "expected_blocks", "concurrency"),
    [
        # TP 1: 67.7 GiB of weights leave ~1 GiB: 3,584 tokens, not one 131,072-token context.
        (H100, H100_BUDGET, 2, 14_569, 1),
        # TP 4 on L4: 16.9 GiB per rank leave less than one context; TP 8 holds one.
        (L4, L4_BUDGET, 8, 14_906, 1),
    ],
)
def test_fp8_llama31_70b(gpu, budget, tp, expected_blocks, concurrency):
    model = shape("Meta-Llama-3.1-70B-Instruct-FP8")
    assert model.quantization.description == "compressed-tensors float8, per-tensor"
    p = plan(model, gpu=gpu)
    reserve = 8192 * (3 * 28672 // tp + 4 * 8192) * 2 + 128256 * LOGITS + GiB
    kv = 2 * 80 * (8 // tp) * 128 * 2
    assert blocks(budget, fp8_70b_weights(tp), reserve, kv) == expected_blocks
    assert (p.tensor_parallel_size, p.max_model_len, p.quantization) == (
        tp,
        131072,
        "compressed-tensors",
    )
    assert (p.weight_bytes_per_gpu, p.reserve_bytes_per_gpu) == (fp8_70b_weights(tp), reserve)
    assert (p.kv_bytes_per_token, p.kv_capacity_tokens) == (kv, expected_blocks * 16)
    assert p.max_concurrency == expected_blocks // (131072 // 16) == concurrency
    # Half the bf16 model's weights (plus the bf16 embeddings and LM head): the bf16 model
    # needs TP 4 on H100s, and on L4s more than one node (TP 8 x PP 2) where FP8 fits one.
    config = json.loads((CONFIGS / "Meta-Llama-3.1-70B-Instruct-FP8.json").read_text())
    bf16 = plan(ModelShape.from_hf_config({**config, "quantization_config": None}), gpu=gpu)
    shape_bf16 = (bf16.tensor_parallel_size, bf16.pipeline_parallel_size)
    assert shape_bf16 == ((4, 1) if gpu is H100 else (8, 2))


# ---- Llama-3-8B-Instruct AWQ (int4, group 128, zero points), float16 ----


def awq_linear(n_in: int, n_out: int) -> int:
    """AutoAWQ GEMM: int4 qweight, a float16 scale and an int4 zero point per 128 inputs."""
    groups = n_in // 128
    return n_in * n_out // 2 + groups * n_out * 2 + groups * n_out // 2


AWQ_8B_WEIGHTS = 32 * (
    2 * awq_linear(4096, 4096)
    + 2 * awq_linear(4096, 1024)
    + 2 * awq_linear(4096, 14336)
    + awq_linear(14336, 4096)
    + 2 * 4096 * 2
) + 2 * (2 * 128256 * 4096 + 4096)


@pytest.mark.parametrize(
    ("gpu", "budget", "expected_blocks", "concurrency"),
    [(H100, H100_BUDGET, 32_931, 64), (L4, L4_BUDGET, 6134, 11)],
)
def test_awq_llama3_8b(gpu, budget, expected_blocks, concurrency):
    model = shape("Meta-Llama-3-8B-Instruct-AWQ")
    # 5.73 GB: the size of the public AWQ checkpoints' safetensors.
    assert AWQ_8B_WEIGHTS == 5_727_854_592
    p = plan(model, gpu=gpu)
    reserve = 8192 * (3 * 14336 + 4 * 4096) * 2 + 128256 * LOGITS + GiB
    assert blocks(budget, AWQ_8B_WEIGHTS, reserve, 131_072) == expected_blocks
    assert (p.tensor_parallel_size, p.dtype, p.quantization) == (1, "float16", "awq")
    assert (p.weight_bytes_per_gpu, p.reserve_bytes_per_gpu) == (AWQ_8B_WEIGHTS, reserve)
    assert p.kv_capacity_tokens == expected_blocks * 16
    assert p.max_concurrency == expected_blocks // (8192 // 16) == concurrency


# ---- fp8 KV cache and forced quantization ----


def test_fp8_kv_cache_doubles_the_tokens():
    llama = shape("Meta-Llama-3-8B")
    auto = plan(llama, gpu=H100)
    fp8 = plan(llama, gpu=H100, kv_cache_dtype="fp8")
    # The same memory left after weights and activations (test_planner: 28,004 blocks of
    # 131,072-byte tokens); one byte per element halves the bytes per token.
    left = (
        H100_BUDGET
        - 2 * 8_030_261_248
        - (8192 * (3 * 14336 + 4 * 4096) * 2 + 128256 * LOGITS + GiB)
    )
    assert (
        (auto.kv_capacity_tokens, fp8.kv_capacity_tokens)
        == (
            left // (131_072 * 16) * 16,
            left // (65_536 * 16) * 16,
        )
        == (448_064, 896_144)
    )
    assert (fp8.kv_bytes_per_token, fp8.max_concurrency, fp8.to_status()["kvCacheDtype"]) == (
        65_536,
        109,
        "fp8",
    )
    assert fp8.weight_bytes_per_gpu == auto.weight_bytes_per_gpu


def test_forced_fp8_quantizes_an_unquantized_checkpoint():
    p = plan(shape("Meta-Llama-3-8B"), gpu=H100, quantization="fp8")
    # 1 byte per decoder weight plus a float32 scale per tensor (7 per layer); embeddings and
    # LM head stay bf16.
    linears = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336
    expected = 32 * (linears + 7 * 4 + 2 * 4096 * 2) + 2 * (2 * 128256 * 4096 + 4096)
    assert (p.weight_bytes_per_gpu, p.quantization) == (expected, "fp8")
    with pytest.raises(PlanError) as caught:
        plan(shape("Meta-Llama-3-8B"), gpu=H100, quantization="awq")
    assert caught.value.reason == "UnsupportedQuantization"
    assert "--quantization awq needs a checkpoint quantized with awq" in caught.value.message
    with pytest.raises(PlanError) as caught:
        plan(shape("Meta-Llama-3-8B-Instruct-AWQ"), gpu=H100, quantization="gptq")
    assert caught.value.message == (
        "quantization gptq: the checkpoint is quantized with awq, not gptq: --quantization "
        "must match the checkpoint's quantization_config"
    )


# ---- beyond one node: Llama-3.1-405B in bf16 ----


def test_llama31_405b_on_h100_is_tp8_by_pp2():
    """811.7 GB of bf16 weights: 101.5 GB per GPU at TP 8, more than an H100's 77.0 GB budget,
    so no single node fits; vLLM's advice: TP = 8 GPUs per node, PP = nodes."""
    model = shape("Meta-Llama-3.1-405B")
    assert model.num_parameters() == 405_853_388_800
    # 126 layers: 63 per stage (vLLM's split); per rank per layer q,o 16384 x 2048,
    # k,v 16384 x 128, MLP 3 x 16384 x 6656, norms 2 x 16384.
    layer = 2 * 16384 * 2048 + 2 * 16384 * 128 + 3 * 16384 * 6656 + 2 * 16384
    first = 2 * (63 * layer + 16032 * 16384)  # the embedding's 128256/8 rows
    last = 2 * (63 * layer + 16032 * 16384 + 16384)  # LM head rows and final norm
    assert [len(r) for r in model.pipeline_stage_layers(2)] == [63, 63]
    reserve = 8192 * (3 * 6656 + 4 * 16384) * 2 + 128256 * LOGITS + GiB
    kv = 2 * 63 * 1 * 128 * 2  # 8 KV heads over 8 ranks, the stage's 63 layers
    for max_model_len, expected_blocks, concurrency in ((8192, 45_781, 89), (None, 45_781, 5)):
        p = plan(model, gpu=H100, max_model_len=max_model_len)
        assert blocks(H100_BUDGET, last, reserve, kv) == expected_blocks
        assert (p.tensor_parallel_size, p.pipeline_parallel_size, p.gpus_per_replica) == (8, 2, 16)
        assert (p.weight_bytes_per_gpu, p.reserve_bytes_per_gpu) == (last, reserve)
        assert first < last
        assert (p.kv_bytes_per_token, p.kv_capacity_tokens) == (kv, expected_blocks * 16)
        assert p.max_concurrency == expected_blocks // (p.max_model_len // 16) == concurrency
        assert p.to_status()["pipelineParallelSize"] == 2
        assert p.nodes_per_replica == 2  # 16 GPUs: one stage on each 8-GPU node


def test_a_user_set_tp_below_the_node_is_pipelined_on_one_node_only():
    """TP 4 x PP 2 is the most one H100 node holds at TP 4 (94.5 GB of weights a GPU): refused,
    naming the shape that fits; at TP 8 the replica spans two nodes."""
    with pytest.raises(PlanError) as caught:
        plan(shape("Meta-Llama-3.1-405B"), gpu=H100, tensor_parallel_size=4)
    assert caught.value.reason == "ModelTooLarge"
    assert caught.value.message.endswith(
        "; tensor parallel size 8 x pipeline parallel size 2 would fit (leave "
        "tensorParallelSize unset)"
    )
    at_eight = plan(shape("Meta-Llama-3.1-405B"), gpu=H100, tensor_parallel_size=8)
    assert (at_eight.tensor_parallel_size, at_eight.pipeline_parallel_size) == (8, 2)
    assert at_eight.nodes_per_replica == 2


# ---- pipelines on one node: a model that fits a node whose GPU count does not divide it ----


def test_a_pipeline_on_one_node_comes_before_one_across_nodes():
    """Qwen2.5-72B in bf16 (145 GB) on 3-GPU H100 nodes: TP 1 and 2 are the valid sizes (64
    heads), TP 2 alone does not hold it; TP 1 x PP 3 fits the node (3 GPUs), where the largest
    TP with more stages, TP 2 x PP 2, would take two nodes. Mixtral-8x7B on 6-GPU L4 nodes: TP
    2 x PP 3 on one node, not TP 4 x PP 2 across two; Qwen3-30B-A3B's 4 KV heads on 12 GiB GPUs:
    TP 4 x PP 2 on one 8-GPU node, not TP 8 x PP 2 (whose KV heads are copies) on two."""
    cases = [
        ("Qwen2.5-72B-Instruct", gpu_type("H100-80GB", per_node=3), (1, 3, 3)),
        ("Mixtral-8x7B-v0.1", gpu_type("L4", per_node=6), (2, 3, 6)),
        ("Qwen3-30B-A3B", gpu_type("custom", memory_gib=12, per_node=8), (4, 2, 8)),
    ]
    for name, gpu, expected in cases:
        p = plan(shape(name), gpu=gpu)
        assert (p.tensor_parallel_size, p.pipeline_parallel_size, p.gpus_per_replica) == expected
        assert p.nodes_per_replica == 1


def test_an_unpadded_awq_checkpoint_splits_only_at_tp1_and_pipelines_on_one_node():
    """Its MLP's 29,568 columns are 231 groups of 128: TP 2 would cut a group, so TP 1 is the
    only valid size; ~42 GB of 4-bit weights need three L4s, asked for or not."""
    model = shape("Qwen2.5-72B-Instruct-AWQ-unpadded")
    for tp in (None, 1):
        p = plan(model, gpu=L4, max_model_len=8192, tensor_parallel_size=tp)
        shape_ = (p.tensor_parallel_size, p.pipeline_parallel_size, p.gpus_per_replica)
        assert shape_ == (1, 3, 3) and p.nodes_per_replica == 1
    # No shape holds 2,000 sequences; pipelining holds the weights, so the KV cache is named.
    with pytest.raises(PlanError) as caught:
        plan(model, gpu=L4, max_model_len=8192, concurrency=2000)
    assert caught.value.reason == "InsufficientKVCache"
    assert "pipeline parallel size" in caught.value.message


def test_adapters_are_refused_on_a_plan_of_more_than_one_gpu():
    """The engine serves LoRA adapters at TP 1 and PP 1 only (it refuses --enable-lora else)."""
    spec = parse_spec(
        {
            "model": {"source": "hf://Qwen/Qwen2.5-72B-Instruct-AWQ"},
            "engine": {"maxModelLen": 8192},
            "gpu": {"type": "L4"},
            "adapters": [{"name": "sql", "source": "hf://someone/qwen-sql-lora"}],
        }
    )
    with pytest.raises(PlanError) as caught:
        plan_for_spec(spec, shape("Qwen2.5-72B-Instruct-AWQ-unpadded"))
    assert caught.value.reason == "UnsupportedAdapters"
    assert "tensor parallel size 1 x pipeline parallel size 3 on L4" in caught.value.message
    on_one_gpu = dataclasses.replace(spec, gpu=dataclasses.replace(spec.gpu, type="H100-80GB"))
    assert (
        plan_for_spec(on_one_gpu, shape("Qwen2.5-72B-Instruct-AWQ-unpadded")).gpus_per_replica == 1
    )


def run_plan_cli(*argv: str) -> int:
    import argparse

    from kvpilot.operator import plan_cli

    parser = argparse.ArgumentParser()
    plan_cli.add_arguments(parser)
    return plan_cli.run(parser.parse_args(argv))


def test_plan_cli_shows_active_parameters_kv_dtype_quantization_and_pp(capsys):
    qwen = str(CONFIGS / "Qwen3-30B-A3B.json")
    assert run_plan_cli(qwen, "--gpu", "L4", "--kv-cache-dtype", "fp8", "--json") == 0
    status = json.loads(capsys.readouterr().out)
    assert status == plan(shape("Qwen3-30B-A3B"), gpu=L4, kv_cache_dtype="fp8").to_status()
    assert (status["kvCapacityTokens"], status["numActiveParameters"]) == (
        20_585 * 16,
        3_353_032_704,
    )
    assert run_plan_cli(qwen, "--gpu", "L4", "--kv-cache-dtype", "fp8") == 0
    table = capsys.readouterr().out
    for row in ("30.53 B", "3.35 B", "kvCacheDtype", "fp8", "pipelineParallelSize"):
        assert row in table
    awq = str(CONFIGS / "Meta-Llama-3-8B-Instruct-AWQ.json")
    assert run_plan_cli(awq, "--gpu", "H100", "-q", "awq") == 0
    assert "awq" in capsys.readouterr().out
    assert run_plan_cli(str(CONFIGS / "Meta-Llama-3.1-405B.json"), "--gpu", "H100") == 0
    table = capsys.readouterr().out
    assert "weights per GPU (largest stage)" in table and "16" in table
    assert run_plan_cli(awq, "--gpu", "H100", "--quantization", "gptq") == 1
    assert "UnsupportedQuantization: quantization gptq:" in capsys.readouterr().err
