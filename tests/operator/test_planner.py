"""The planner on real public configs, against sizes worked out by hand.

Each expected value is written as the arithmetic a person does with the numbers of the
config and the GPU (the memory model is in operator/planner.py's docstring):

    budget      = total memory * gpu_memory_utilization
    weights     = parameters on this rank * dtype bytes
    reserve     = batched tokens * (3 * intermediate/tp + 4 * hidden) * dtype bytes
                  + max_num_seqs * vocab * 4 (float32 logits) + 1 GiB runtime (GPU)
    blocks      = (budget - weights - reserve) // (kv bytes per token * block size)

with the engine's block size: 16 tokens on a GPU, 8 on CPU.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kvpilot.engine.model_shape import ModelShape
from kvpilot.operator.gpus import CATALOGUE, GiB, MiB, gpu_type
from kvpilot.operator.planner import PlanError, default_gpu_memory_utilization, plan

CONFIGS = Path(__file__).parent / "configs"
H100 = CATALOGUE["H100-80GB"]
L4 = CATALOGUE["L4"]


def spec(name: str, **changes) -> ModelShape:
    return ModelShape.from_hf_config(
        {**json.loads((CONFIGS / f"{name}.json").read_text()), **changes}
    )


# Budgets of the two GPUs most cases use: 81,559 MiB at 0.90 and 23,034 MiB at 0.86.
H100_BUDGET = int(81_559 * MiB * 0.90)
L4_BUDGET = int(23_034 * MiB * 0.86)
# Llama-3-8B (and Mistral-7B) at TP 1, bf16, 8192 batched tokens, 256 sequences.
LLAMA3_8B_WEIGHTS = 2 * 8_030_261_248
LLAMA3_8B_RESERVE = 8192 * (3 * 14336 + 4 * 4096) * 2 + 256 * 128256 * 4 + GiB


def test_llama3_8b_on_h100():
    p = plan(spec("Meta-Llama-3-8B"), gpu=H100)
    blocks = (H100_BUDGET - LLAMA3_8B_WEIGHTS - LLAMA3_8B_RESERVE) // (131_072 * 16)
    assert blocks == 28_004
    assert (p.tensor_parallel_size, p.gpus_per_replica, p.gpu_memory_utilization) == (1, 1, 0.90)
    assert (p.dtype, p.max_model_len) == ("bfloat16", 8192)
    assert p.weight_bytes_per_gpu == LLAMA3_8B_WEIGHTS
    assert p.reserve_bytes_per_gpu == LLAMA3_8B_RESERVE
    assert p.kv_bytes_per_token == 131_072
    assert p.kv_capacity_tokens == 28_004 * 16 == 448_064
    assert p.max_concurrency == 28_004 // (8192 // 16) == 54


def test_llama3_8b_on_l4_lowers_utilization_for_headroom():
    p = plan(spec("Meta-Llama-3-8B"), gpu=L4)
    # 1 - 3 GiB / 22.49 GiB = 0.8666 -> 0.86
    assert p.gpu_memory_utilization == 0.86
    blocks = (L4_BUDGET - LLAMA3_8B_WEIGHTS - LLAMA3_8B_RESERVE) // (131_072 * 16)
    assert blocks == 1207
    assert (p.tensor_parallel_size, p.kv_capacity_tokens, p.max_concurrency) == (1, 19_312, 2)


def test_llama3_70b_on_h100_needs_tp2_for_one_sequence():
    p = plan(spec("Meta-Llama-3-70B"), gpu=H100, max_model_len=8192)
    # Per rank at TP 2: embeddings 2 * 64128*8192; per layer q,o 2 * 8192*4096, k,v 2 * 8192*512,
    # MLP 3 * 8192*14336, norms 2*8192 = 427,835,392, * 80 layers; final norm 8192.
    params = 2 * 64128 * 8192 + 80 * 427_835_392 + 8192
    assert p.weight_bytes_per_gpu == 2 * params == 70_555_025_408
    reserve = 8192 * (3 * 14336 + 4 * 8192) * 2 + 256 * 128256 * 4 + GiB
    blocks = (H100_BUDGET - 2 * params - reserve) // (2 * 80 * 4 * 128 * 2 * 16)
    assert blocks == 1513
    assert p.tensor_parallel_size == 2
    assert p.kv_bytes_per_token == 163_840
    assert (p.kv_capacity_tokens, p.max_concurrency) == (24_208, 2)


def test_llama3_70b_concurrency_asks_for_tp4():
    p = plan(spec("Meta-Llama-3-70B"), gpu=H100, max_model_len=8192, concurrency=32)
    # TP 2 holds 2 sequences; TP 3 does not split 64 heads; TP 4:
    reserve = 8192 * (3 * 7168 + 4 * 8192) * 2 + 256 * 128256 * 4 + GiB
    blocks = (H100_BUDGET - p.weight_bytes_per_gpu - reserve) // (81_920 * 16)
    assert blocks == 30_209
    assert (p.tensor_parallel_size, p.gpus_per_replica) == (4, 4)
    assert p.reserve_bytes_per_gpu == reserve
    assert (p.kv_capacity_tokens, p.max_concurrency) == (483_344, 59)


def test_qwen25_72b_at_full_context_needs_tp4():
    p = plan(spec("Qwen2.5-72B-Instruct"), gpu=H100)
    assert (p.max_model_len, p.tensor_parallel_size) == (32768, 4)
    assert p.max_concurrency == p.kv_capacity_tokens // 32768 >= 1


def test_qwen25_72b_at_tp2_holds_8k_and_pipelines_for_its_full_context():
    # Per rank at TP 2: embeddings 2 * 76032*8192; per layer q 8192*4096 + 4096 bias,
    # k,v 2 * (8192*512 + 512), o 4096*8192, MLP 3 * 8192*14784, norms 16384; final norm.
    layer = (8192 * 4096 + 4096) + 2 * (8192 * 512 + 512) + 4096 * 8192 + 3 * 8192 * 14784 + 16384
    weights = 2 * (2 * 76032 * 8192 + 80 * layer + 8192)
    reserve = 8192 * (3 * 14784 + 4 * 8192) * 2 + 256 * 152064 * 4 + GiB
    blocks = (H100_BUDGET - weights - reserve) // (163_840 * 16)
    assert blocks == 674
    shorter = plan(spec("Qwen2.5-72B-Instruct"), gpu=H100, max_model_len=8192)
    assert (shorter.tensor_parallel_size, shorter.kv_capacity_tokens) == (2, 10_784)
    # 10,784 tokens are short of its 32,768: at a requested TP 2 a second stage on the same
    # node (4 GPUs, half the layers each) holds them; unasked, TP 4 does.
    full = plan(spec("Qwen2.5-72B-Instruct"), gpu=H100, tensor_parallel_size=2)
    assert (full.tensor_parallel_size, full.pipeline_parallel_size, full.gpus_per_replica) == (
        2,
        2,
        4,
    )
    assert full.nodes_per_replica == 1
    assert plan(spec("Qwen2.5-72B-Instruct"), gpu=H100).tensor_parallel_size == 4


def test_mistral_7b_32k_context_on_l4_takes_two_gpus():
    reserve = 8192 * (3 * 14336 + 4 * 4096) * 2 + 256 * 32000 * 4 + GiB
    blocks_tp1 = (L4_BUDGET - 2 * 7_241_732_096 - reserve) // (131_072 * 16)
    assert blocks_tp1 == 2006  # < 32768 / 16 = 2048 blocks for one sequence
    assert plan(spec("Mistral-7B-v0.1"), gpu=L4).tensor_parallel_size == 2
    p = plan(spec("Mistral-7B-v0.1"), gpu=L4, max_model_len=16384)
    assert (p.tensor_parallel_size, p.kv_capacity_tokens, p.max_concurrency) == (1, 32_096, 1)


def test_smollm2_on_cpu_sizes_kv_from_the_memory_limit():
    p = plan(spec("SmolLM2-135M-Instruct"), gpu=None, memory_bytes=3 * GiB, max_model_len=4096)
    # float32 on CPU; budget 3 GiB - 1.5 GiB runtime; 512 batched tokens, 64 sequences; the
    # engine's CPU block size, 8 tokens.
    weights = 4 * 134_515_008
    reserve = 512 * (3 * 1536 + 4 * 576) * 4 + 64 * 49152 * 4
    blocks = (3 * GiB - 3 * GiB // 2 - weights - reserve) // (2 * 30 * 3 * 64 * 4 * 8)
    assert blocks == 2836 and p.block_size == 8
    assert (p.gpu_type, p.dtype, p.tensor_parallel_size, p.gpus_per_replica) == (
        "cpu",
        "float32",
        1,
        0,
    )
    assert p.gpu_memory_utilization is None
    assert p.kv_cache_bytes_per_gpu == 2836 * 8 * 46_080
    assert (p.kv_capacity_tokens, p.max_concurrency) == (22_688, 5)
    assert "gpuMemoryUtilization" not in p.to_status()


@pytest.mark.parametrize(
    ("kwargs", "reason", "words"),
    [
        ({"max_model_len": 8193}, "MaxModelLenTooLarge", "8193 exceeds .* 8192"),
        ({"tensor_parallel_size": 3}, "InvalidTensorParallelSize", "32 is not divisible by .* 3"),
        ({"tensor_parallel_size": 16}, "InvalidTensorParallelSize", "16 exceeds the 8 GPUs"),
    ],
)
def test_refusals_name_the_numbers(kwargs, reason, words):
    with pytest.raises(PlanError, match=words) as caught:
        plan(spec("Meta-Llama-3-8B"), gpu=H100, **kwargs)
    assert caught.value.reason == reason


def test_model_too_large_names_the_largest_tp_tried():
    four_l4 = gpu_type("L4", per_node=4)
    # 100,000 sequences' float32 logits (100,000 * 128,256 * 4 bytes = 47.8 GiB) exceed an L4
    # whatever the split: no pipeline parallel size helps either, and the one-node error stands.
    with pytest.raises(PlanError) as caught:
        plan(spec("Meta-Llama-3-70B"), gpu=four_l4, max_num_seqs=100_000)
    assert caught.value.reason == "ModelTooLarge"
    assert caught.value.message.endswith(
        "even at tensor parallel size 4, the largest valid one with 4 L4 per node"
    )


# Llama-3-70B in bf16 holds 70,553,706,496 parameters: 131.4 GiB of weights on one GPU, 65.7
# GiB at TP 2 (test_llama3_70b_on_h100_needs_tp2_for_one_sequence); an H100's budget is 71.7 GiB.
LLAMA3_70B_BYTES = 2 * 70_553_706_496


def test_a_forced_tp_that_one_gpu_cannot_hold_takes_pipeline_stages_on_its_node():
    assert (round(LLAMA3_70B_BYTES / GiB, 1), round(H100_BUDGET / GiB, 1)) == (131.4, 71.7)
    # 131.4 GiB of weights at TP 1: two stages of 65.7 GiB on the node's GPUs.
    at_one = plan(spec("Meta-Llama-3-70B"), gpu=H100, tensor_parallel_size=1)
    assert (at_one.tensor_parallel_size, at_one.pipeline_parallel_size) == (1, 2)
    assert (at_one.gpus_per_replica, at_one.nodes_per_replica) == (2, 1)
    at_two = plan(spec("Meta-Llama-3-70B"), gpu=H100, tensor_parallel_size=2)
    assert (at_two.kv_capacity_tokens, at_two.max_concurrency) == (24_208, 2)
    assert at_two.pipeline_parallel_size == 1
    # On 1-GPU nodes TP 1 is the whole node: the second stage is a second node.
    one_gpu_nodes = gpu_type("H100-80GB", per_node=1)
    across = plan(spec("Meta-Llama-3-70B"), gpu=one_gpu_nodes, tensor_parallel_size=1)
    assert (across.pipeline_parallel_size, across.nodes_per_replica) == (2, 2)


def test_a_gpu_no_larger_than_the_headroom_is_named_not_given_a_negative_budget():
    tiny = gpu_type("custom", memory_gib=2)
    with pytest.raises(PlanError) as caught:
        plan(spec("Meta-Llama-3-8B"), gpu=tiny)
    assert caught.value.reason == "GpuTooSmall"
    assert caught.value.message.startswith("custom has 2.0 GiB, no more than the 3.0 GiB kept")
    # An explicit utilization is the user's: planned (and refused) by its own budget.
    with pytest.raises(PlanError) as caught:
        plan(spec("Meta-Llama-3-8B"), gpu=tiny, gpu_memory_utilization=0.9)
    assert caught.value.reason == "ModelTooLarge" and "1.8 GiB budget" in caught.value.message


def test_a_forced_tp_that_no_node_holds_names_the_pipeline_that_would():
    with pytest.raises(PlanError) as caught:
        plan(spec("Meta-Llama-3-70B"), gpu=gpu_type("L4", per_node=4), tensor_parallel_size=2)
    assert caught.value.reason == "ModelTooLarge"
    # TP 2 x PP 2 fills the 4-GPU node and still does not hold it; a requested size below the
    # GPUs per node does not span nodes, so the error names the shape that would.
    assert "at the requested tensor parallel size 2 on L4" in caught.value.message
    assert caught.value.message.endswith(
        "; tensor parallel size 4 x pipeline parallel size 2 would fit (leave tensorParallelSize "
        "unset)"
    )


def test_model_too_large_on_cpu_names_the_memory_limit():
    with pytest.raises(PlanError) as caught:
        plan(spec("Meta-Llama-3-8B"), gpu=None, memory_bytes=8 * GiB)
    assert caught.value.reason == "ModelTooLarge"
    # float32 on CPU: 4 * 8,030,261,248 bytes = 29.9 GiB; budget 8 - 1.5 GiB.
    assert caught.value.message.startswith(
        "8.0B parameters in float32: weights 29.9 GiB + activations 0.1 GiB per process exceed "
        "the 6.5 GiB budget (8.0 GiB memory limit less 1.5 GiB runtime)"
    )
    assert "tensor parallel" not in caught.value.message


def test_unsupported_models():
    gemma2 = spec("Meta-Llama-3-8B", architectures=["Gemma2ForCausalLM"], model_type="gemma2")
    with pytest.raises(PlanError) as caught:
        plan(gemma2, gpu=H100)
    assert caught.value.reason == "UnsupportedArchitecture"
    assert "Gemma2ForCausalLM" in caught.value.message
    bnb = spec("Mistral-7B-v0.1", quantization_config={"quant_method": "bitsandbytes"})
    with pytest.raises(PlanError) as caught:
        plan(bnb, gpu=H100)
    assert caught.value.reason == "UnsupportedQuantization"
    assert "quantization method 'bitsandbytes' is not supported" in caught.value.message
    assert caught.value.message.endswith("loads fp8, compressed-tensors, awq, gptq")
    # An architecture the engine does not run is refused for that, whatever its quantization
    # (gpt-oss: MXFP4 experts).
    gpt_oss = spec(
        "Mixtral-8x7B-v0.1",
        architectures=["GptOssForCausalLM"],
        model_type="gpt_oss",
        quantization_config={"quant_method": "mxfp4"},
    )
    with pytest.raises(PlanError) as caught:
        plan(gpt_oss, gpu=H100)
    assert caught.value.reason == "UnsupportedArchitecture"
    assert "'GptOssForCausalLM' is not implemented" in caught.value.message


@pytest.mark.parametrize(
    ("name", "quantization_config", "quantization"),
    [
        ("Mixtral-8x7B-v0.1", {"quant_method": "awq", "bits": 4, "group_size": 128}, None),
        ("Qwen3-30B-A3B", None, "fp8"),
    ],
    ids=["awq-checkpoint", "fp8-online"],
)
def test_a_quantized_mixture_of_experts_is_refused_as_the_engine_refuses_it(
    name, quantization_config, quantization
):
    model = spec(name, quantization_config=quantization_config)
    with pytest.raises(PlanError) as caught:
        plan(model, gpu=H100, quantization=quantization)
    method = quantization or quantization_config["quant_method"]
    assert (caught.value.reason, caught.value.message) == (
        "UnsupportedQuantization",
        f"a quantized mixture of experts ({method}) is not supported by the kvpilot engine: "
        "serve the unquantized checkpoint, without --quantization",
    )
    assert not model.quantized_as(quantization).is_supported_by_engine


@pytest.mark.parametrize(
    ("quantization_config", "message"),
    [
        (
            {"bits": 4},
            "the checkpoint is quantized: quantization_config has no quant_method: the "
            "quantization method is missing (the kvpilot engine loads fp8, compressed-tensors, "
            "awq, gptq)",
        ),
        (
            '{"quant_method": "awq", "bits": ',
            "the checkpoint is quantized: quantization_config is a string that is not valid "
            "JSON: Expecting value: line 1 column 32 (char 31)",
        ),
        (
            7,
            "the checkpoint is quantized: quantization_config must be an object (or a method "
            "name, or an object's JSON text), got int",
        ),
    ],
    ids=["no-method", "bad-json-string", "a-number"],
)
def test_a_quantization_config_that_names_no_method_is_refused_saying_so(
    quantization_config, message
):
    with pytest.raises(PlanError) as caught:
        plan(spec("Mistral-7B-v0.1", quantization_config=quantization_config), gpu=H100)
    assert caught.value.reason == "UnsupportedQuantization"
    assert caught.value.message == message


def test_a_quantization_config_string_or_upper_case_method_plans_as_the_method():
    fp8 = plan(spec("Mistral-7B-v0.1", quantization_config={"quant_method": "fp8"}), gpu=H100)
    for given in ("fp8", "FP8", '{"quant_method": "fp8"}', {"quant_method": "FP8"}):
        model = spec("Mistral-7B-v0.1", quantization_config=given)
        assert model.quantization_method == "fp8"
        assert plan(model, gpu=H100) == fp8


def test_cpu_mode_is_one_process():
    with pytest.raises(PlanError) as caught:
        plan(spec("SmolLM2-135M-Instruct"), gpu=None, memory_bytes=4 * GiB, tensor_parallel_size=2)
    assert caught.value.reason == "InvalidTensorParallelSize"
    with pytest.raises(ValueError, match="memory_bytes"):
        plan(spec("SmolLM2-135M-Instruct"), gpu=None)


def test_a_cpu_limit_below_the_runtime_names_the_runtime_not_a_negative_budget():
    with pytest.raises(PlanError) as caught:
        plan(spec("SmolLM2-135M-Instruct"), gpu=None, memory_bytes=100 * MiB)
    assert caught.value.reason == "ModelTooLarge"
    assert "does not cover the engine's CPU runtime" in caught.value.message
    assert "-" not in caught.value.message.split("runtime")[0]


def test_explicit_utilization_and_custom_gpu():
    p = plan(spec("Meta-Llama-3-8B"), gpu=L4, gpu_memory_utilization=0.95)
    blocks = (int(23_034 * MiB * 0.95) - LLAMA3_8B_WEIGHTS - LLAMA3_8B_RESERVE) // (131_072 * 16)
    assert (p.gpu_memory_utilization, p.kv_capacity_tokens) == (0.95, blocks * 16)
    custom = gpu_type("custom", memory_gib=48)
    assert (custom.memory_bytes, custom.per_node) == (48 * GiB, 1)
    assert plan(spec("Meta-Llama-3-8B"), gpu=custom).gpu_type == "custom"
    with pytest.raises(PlanError, match="exceeds the 1 GPUs per node"):
        plan(spec("Meta-Llama-3-8B"), gpu=custom, tensor_parallel_size=2)


@pytest.mark.parametrize(
    ("name", "utilization"),
    [("L4", 0.86), ("A10G", 0.86), ("L40S", 0.90), ("A100-40GB", 0.90), ("B200", 0.90)],
)
def test_default_utilization_rule(name, utilization):
    assert default_gpu_memory_utilization(CATALOGUE[name]) == utilization


def test_plan_as_status_is_camel_case():
    status = plan(spec("Meta-Llama-3-8B"), gpu=H100).to_status()
    assert status == {
        "gpuType": "H100-80GB",
        "dtype": "bfloat16",
        "tensorParallelSize": 1,
        "pipelineParallelSize": 1,
        "nodesPerReplica": 1,
        "gpusPerReplica": 1,
        "gpuMemoryUtilization": 0.9,
        "maxModelLen": 8192,
        "numParameters": 8_030_261_248,
        "numActiveParameters": 8_030_261_248,
        "weightBytesPerGpu": LLAMA3_8B_WEIGHTS,
        "kvCacheDtype": "auto",
        "kvBytesPerToken": 131_072,
        "kvCacheBytesPerGpu": 448_064 * 131_072,
        "kvCapacityTokens": 448_064,
        "maxConcurrency": 54,
    }


def run_plan_cli(*argv: str) -> int:
    import argparse

    from kvpilot.operator import plan_cli

    parser = argparse.ArgumentParser()
    plan_cli.add_arguments(parser)
    return plan_cli.run(parser.parse_args(argv))


def test_plan_cli_prints_the_plan(capsys):
    config = str(CONFIGS / "Meta-Llama-3-70B.json")
    assert run_plan_cli(config, "--gpu", "H100-80GB", "--max-model-len", "8192", "--json") == 0
    expected = plan(spec("Meta-Llama-3-70B"), gpu=H100, max_model_len=8192).to_status()
    assert json.loads(capsys.readouterr().out) == expected
    assert run_plan_cli(config, "--gpu", "H100-80GB", "--max-model-len", "8192") == 0
    table = capsys.readouterr().out
    assert "tensorParallelSize" in table and "24,208 tokens" in table


def test_plan_cli_reports_why_it_cannot_plan(capsys):
    assert run_plan_cli(str(CONFIGS / "DeepSeek-V3.json"), "--gpu", "H100-80GB") == 1
    assert "UnsupportedArchitecture: 'DeepseekV3ForCausalLM' is not implemented" in (
        capsys.readouterr().err
    )


@pytest.mark.parametrize("typed", ["H100", "h100-80gb", "H100-80GB", "h100"])
def test_plan_cli_takes_gpu_names_in_any_case_and_by_unique_first_part(typed, capsys):
    config = str(CONFIGS / "Meta-Llama-3-8B.json")
    assert run_plan_cli(config, "--gpu", typed, "--json") == 0
    assert json.loads(capsys.readouterr().out)["gpuType"] == "H100-80GB"


@pytest.mark.parametrize(
    ("typed", "error"),
    [
        ("A100", "argument --gpu: gpu type 'A100' is ambiguous: A100-40GB or A100-80GB"),
        ("L40", "argument --gpu: unknown gpu type 'L40'; known: L4, A10G, L40S,"),
    ],
)
def test_plan_cli_refuses_ambiguous_and_unknown_gpu_names(typed, error, capsys):
    with pytest.raises(SystemExit) as exited:
        run_plan_cli(str(CONFIGS / "Meta-Llama-3-8B.json"), "--gpu", typed)
    assert exited.value.code == 2
    assert error in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["--gpu", "custom"], "error: --gpu-memory-gib: required when --gpu is custom\n"),
        (
            ["--gpu", "L4", "--gpu-memory-gib", "24"],
            "error: --gpu-memory-gib: only for type custom; L4 has known memory\n",
        ),
        (["--gpu", "L4", "--max-model-len", "0"], "error: --max-model-len: must be >= 1 (got 0)\n"),
        (["--gpu", "L4", "--per-node", "0"], "error: --per-node: must be >= 1 (got 0)\n"),
        (
            ["--gpu", "L4", "--gpu-memory-utilization", "1.5"],
            "error: --gpu-memory-utilization: must be <= 1 (got 1.5)\n",
        ),
        (
            ["--gpu", "cpu", "--memory", "banana"],
            "error: --memory: 'banana' is not a Kubernetes quantity (e.g. 4Gi, 500m)\n",
        ),
        (
            ["--gpu", "cpu", "-tp", "2"],
            "error: --tensor-parallel-size: CPU mode (--gpu cpu) runs one process: 1\n",
        ),
        (
            ["--gpu", "L4", "--revision", "main"],
            "error: --revision: only meaningful for hf:// sources\n",
        ),
    ],
)
def test_plan_cli_errors_name_the_flags_typed(argv, error, capsys):
    assert run_plan_cli(str(CONFIGS / "Meta-Llama-3-8B.json"), *argv) == 2
    assert capsys.readouterr().err == error


def test_plan_cli_says_a_folder_has_no_config_json(tmp_path, capsys):
    assert run_plan_cli(str(tmp_path), "--gpu", "L4") == 2
    assert capsys.readouterr().err == f"error: model: no config.json in {tmp_path}\n"
    assert run_plan_cli(f"file://{tmp_path}", "--gpu", "L4") == 2
    assert capsys.readouterr().err == f"error: model: no config.json in file://{tmp_path}\n"
    (tmp_path / "config.json").write_text((CONFIGS / "Meta-Llama-3-8B.json").read_text())
    assert run_plan_cli(str(tmp_path), "--gpu", "L4", "--json") == 0
    assert json.loads(capsys.readouterr().out) == plan(spec("Meta-Llama-3-8B"), gpu=L4).to_status()


@pytest.mark.parametrize(
    ("name", "layers", "kv_heads", "head_dim", "hidden", "intermediate", "vocab", "parameters"),
    [
        # Parameter counts worked out in test_model_spec.py's docstring.
        ("granite-3.3-8b-instruct", 40, 8, 128, 4096, 12800, 49159, 8_170_864_640),
        ("Phi-3-mini-4k-instruct", 32, 32, 96, 3072, 8192, 32064, 3_821_079_552),
        ("gemma-7b", 28, 16, 256, 3072, 24576, 256000, 8_537_680_896),
    ],
)
def test_plan_cli_sizes_granite_phi3_and_gemma_folders(
    tmp_path, capsys, name, layers, kv_heads, head_dim, hidden, intermediate, vocab, parameters
):
    (tmp_path / "config.json").write_text((CONFIGS / f"{name}.json").read_text())
    assert run_plan_cli(str(tmp_path), "--gpu", "H100", "--json") == 0
    status = json.loads(capsys.readouterr().out)
    kv_bytes = 2 * layers * kv_heads * head_dim * 2  # K and V, bf16
    reserve = 8192 * (3 * intermediate + 4 * hidden) * 2 + 256 * vocab * 4 + GiB
    blocks = (H100_BUDGET - 2 * parameters - reserve) // (kv_bytes * 16)
    assert (status["tensorParallelSize"], status["dtype"]) == (1, "bfloat16")
    assert status["kvBytesPerToken"] == kv_bytes
    assert status["weightBytesPerGpu"] == 2 * parameters
    assert status["kvCapacityTokens"] == blocks * 16
    assert status == plan(spec(name), gpu=H100).to_status()


def test_plan_cli_refuses_a_claim_and_a_file_that_is_not_json(tmp_path, capsys):
    assert run_plan_cli("pvc://models/llama", "--gpu", "L4") == 2
    assert "error: model: kvpilot plan cannot read a claim" in capsys.readouterr().err
    broken = tmp_path / "config.json"
    broken.write_text("{not json")
    assert run_plan_cli(str(broken), "--gpu", "L4") == 2
    assert f"error: model: {broken} is not JSON: " in capsys.readouterr().err
    # null is not "no config" (which would plan the built-in model).
    broken.write_text("null")
    assert run_plan_cli(str(broken), "--gpu", "L4") == 2
    assert f"error: model: {broken}: must be an object, got null" in capsys.readouterr().err
    # A config's own problems name the model argument, not the spec's field path.
    broken.write_text('{"hidden_size": 8}')
    assert run_plan_cli(str(broken), "--gpu", "L4") == 1
    assert capsys.readouterr().err == (
        "cannot plan: InvalidModelConfig: model: model config is missing 'num_hidden_layers'\n"
    )
    llama = json.loads((CONFIGS / "Meta-Llama-3-8B.json").read_text())
    nameless = {**llama, "architectures": None, "model_type": None}
    broken.write_text(json.dumps(nameless))
    assert run_plan_cli(str(broken), "--gpu", "L4") == 1
    assert (
        "UnsupportedArchitecture: a config with neither 'architectures' nor 'model_type' is not "
        "implemented by the kvpilot engine; supported: " in capsys.readouterr().err
    )


def llama3_8b_stating(field: str, dtype: str) -> dict:
    """Llama-3-8B's config.json with its dtype stated in ``field`` alone."""
    llama = json.loads((CONFIGS / "Meta-Llama-3-8B.json").read_text())
    return {**{k: v for k, v in llama.items() if k != "torch_dtype"}, field: dtype}


@pytest.mark.parametrize(
    ("stated", "auto"),
    [
        ("bfloat16", "bfloat16"),
        ("torch.bfloat16", "bfloat16"),  # older exports
        ("float16", "float16"),
        ("half", "float16"),  # an alias was sized as bfloat16, unlike the engine
        ("float32", "bfloat16"),
        ("float", "bfloat16"),
        ("float8_e4m3fn", "bfloat16"),  # FP8 checkpoints state their weights' format
    ],
)
def test_each_accepted_checkpoint_dtype_plans_as_the_engine_runs_it(stated, auto):
    for field in ("torch_dtype", "dtype"):  # transformers 5 writes "dtype"
        p = plan(ModelShape.from_hf_config(llama3_8b_stating(field, stated)), gpu=H100)
        assert (p.dtype, p.weight_bytes_per_gpu) == (auto, LLAMA3_8B_WEIGHTS)


def test_a_config_states_no_dtype_only_by_none_an_empty_name_or_auto():
    from kvpilot.engine.model_shape import checkpoint_dtype

    for stated in (None, "", "auto"):
        assert checkpoint_dtype({"torch_dtype": stated}) is None
    assert checkpoint_dtype({"torch_dtype": "", "dtype": "half"}) == "float16"
    for value in (0, False, 5, ["bfloat16"]):  # 0 and false were taken for "not stated"
        with pytest.raises(ValueError, match=re.escape(f"got {value!r}")):
            checkpoint_dtype({"torch_dtype": value})


def test_plan_cli_refuses_an_unknown_checkpoint_dtype(tmp_path, capsys):
    # "int3" was planned as bfloat16; it names no dtype a checkpoint is stored in.
    config = tmp_path / "config.json"
    for field in ("torch_dtype", "dtype"):
        config.write_text(json.dumps(llama3_8b_stating(field, "int3")))
        assert run_plan_cli(str(config), "--gpu", "H100") == 1
        assert capsys.readouterr().err == (
            f"cannot plan: InvalidModelConfig: model: '{field}' (the checkpoint's dtype) must "
            "be one of float32, float, float16, half, bfloat16, float8_e4m3fn, float8_e5m2, "
            "got 'int3'\n"
        )
    with pytest.raises(ValueError, match="'torch_dtype' .* got 'int3'"):
        plan(spec("Meta-Llama-3-8B", torch_dtype="int3"), gpu=H100)


def test_plan_cli_table_on_cpu_speaks_per_replica(capsys):
    config = str(CONFIGS / "SmolLM2-135M-Instruct.json")
    assert run_plan_cli(config, "--gpu", "cpu", "--memory", "3Gi", "--max-model-len", "4096") == 0
    table = capsys.readouterr().out
    # The numbers of test_smollm2_on_cpu_sizes_kv_from_the_memory_limit.
    assert "KV cache per replica" in table and "22,688 tokens" in table
    assert "weights per replica" in table and "per GPU" not in table


def test_plan_cli_refuses_a_missing_local_file_and_a_zero_memory_limit(capsys, monkeypatch):
    # A mistyped path was fetched from the Hub as hf://<path> (network retries, then a
    # confusing error); a zero memory limit was a ValueError traceback from the planner.
    import huggingface_hub

    def no_network(*args, **kwargs):
        raise AssertionError("a local path must not be looked up on the Hub")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", no_network)
    assert run_plan_cli("no/such/config.json", "--gpu", "L4") == 2
    assert "no/such/config.json: no such file or folder" in capsys.readouterr().err
    assert run_plan_cli("./no-such-model", "--gpu", "L4") == 2
    assert "no such file or folder" in capsys.readouterr().err
    assert run_plan_cli("--gpu", "cpu", "--memory", "0") == 2
    assert "error: --memory: must be more than 0 in CPU mode (--gpu cpu)" in capsys.readouterr().err
