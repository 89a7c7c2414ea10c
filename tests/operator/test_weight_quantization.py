"""Bytes of quantized linear layers per format, the layers each format leaves unquantized, and
the tensor-parallel shards vLLM can build, worked out by hand."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpilot.engine.model_shape import ModelShape, check_tensor_parallel_size
from kvpilot.engine.weight_quantization import (
    UnsupportedQuantizationError,
    online_quantization,
    parse_quantization_config,
)

CONFIGS = Path(__file__).parent / "configs"


def load(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text())


W4A16 = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {
                "num_bits": 4,
                "type": "int",
                "strategy": "group",
                "group_size": 128,
                "symmetric": True,
            },
        }
    },
    "ignore": ["lm_head", "re:.*mlp.gate$"],
}


@pytest.mark.parametrize(
    ("config", "in_out", "expected"),
    [
        # AutoFP8 (quant_method fp8, static): fp8 weights, a float32 weight and input scale.
        ({"quant_method": "fp8", "activation_scheme": "static"}, (4096, 1024), 4096 * 1024 + 8),
        ({"quant_method": "fp8", "activation_scheme": "dynamic"}, (4096, 1024), 4096 * 1024 + 4),
        # DeepSeek-V3's block fp8: a float32 weight_scale_inv per 128x128 block (16 x 56 blocks).
        (
            {"quant_method": "fp8", "weight_block_size": [128, 128]},
            (7168, 2048),
            7168 * 2048 + 16 * 56 * 4,
        ),
        # compressed-tensors W4A16 group 128, symmetric: packed int4, a bf16 scale per group.
        (W4A16, (4096, 14336), 4096 * 14336 // 2 + 14336 * 32 * 2),
        # AWQ: int4, a float16 scale and an int4 zero point per group of 128 inputs.
        (
            {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True},
            (14336, 4096),
            14336 * 4096 // 2 + 112 * 4096 * 2 + 112 * 4096 // 2,
        ),
        # GPTQ: as AWQ plus an int32 g_idx per input channel.
        (
            {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False},
            (4096, 4096),
            4096 * 4096 // 2 + 32 * 4096 * 2 + 32 * 4096 // 2 + 4096 * 4,
        ),
        # GPTQ 8-bit, one group per output channel (group_size -1).
        (
            {"quant_method": "gptq", "bits": 8, "group_size": -1},
            (4096, 4096),
            4096 * 4096 + 4096 * 2 + 4096 + 4096 * 4,
        ),
    ],
)
def test_linear_bytes_per_format(config, in_out, expected):
    assert parse_quantization_config(config).linear_bytes(*in_out, dtype_bytes=2) == expected


def test_compressed_tensors_fp8_channel_and_asymmetric_int4():
    channel = {
        **W4A16,
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
                "input_activations": {"num_bits": 8, "type": "float", "dynamic": True},
            }
        },
    }
    # A bf16 scale per output channel; dynamic activations store no scale.
    assert parse_quantization_config(channel).linear_bytes(4096, 1024, 2) == 4096 * 1024 + 1024 * 2
    asymmetric = json.loads(json.dumps(W4A16))
    asymmetric["config_groups"]["group_0"]["weights"]["symmetric"] = False
    # Plus an int4 zero point per scale.
    assert parse_quantization_config(asymmetric).linear_bytes(4096, 1024, 2) == (
        4096 * 1024 // 2 + 1024 * 32 * 2 + 1024 * 32 // 2
    )


def test_ignored_layers_stay_at_the_checkpoint_dtype():
    ct = parse_quantization_config(W4A16)
    assert ct.quantizes("model.layers.0.mlp.experts.0.gate_proj")
    assert not ct.quantizes("model.layers.3.mlp.gate")  # the regex: the router
    assert not ct.quantizes("lm_head")
    awq = parse_quantization_config(
        {"quant_method": "awq", "bits": 4, "group_size": 128, "modules_to_not_convert": ["gate"]}
    )
    # AWQ matches by substring, as vLLM's is_layer_skipped_awq does.
    assert not awq.quantizes("model.layers.0.block_sparse_moe.gate")
    assert awq.quantizes("model.layers.0.block_sparse_moe.experts.0.w1")
    # An fp8 checkpoint that keeps layer 0's MLP in bf16: exactly those three layers more.
    config = load("Meta-Llama-3-8B")
    skipped = ["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"]
    skipped.append("model.layers.0.mlp.down_proj")
    fp8 = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    all_fp8 = ModelShape.from_hf_config({**config, "quantization_config": fp8})
    some = ModelShape.from_hf_config(
        {**config, "quantization_config": {**fp8, "ignored_layers": skipped}}
    )
    assert some.weight_bytes(2) - all_fp8.weight_bytes(2) == 3 * (
        4096 * 14336 * 2 - 4096 * 14336 - 4
    )


def test_online_fp8_and_methods_that_need_their_own_checkpoint():
    assert online_quantization("fp8").description == "fp8 float8, per-tensor"
    with pytest.raises(
        UnsupportedQuantizationError, match="needs a checkpoint quantized with gptq"
    ):
        online_quantization("gptq")
    llama = ModelShape.from_hf_config(load("Meta-Llama-3-8B"))
    assert llama.quantized_as(None) is llama
    assert llama.quantized_as("fp8").quantization_method == "fp8"


@pytest.mark.parametrize(
    ("config", "words"),
    [
        ({"quant_method": "bitsandbytes"}, "'bitsandbytes' is not supported"),
        ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size must be"),
        (
            {
                **W4A16,
                "config_groups": {
                    "group_0": {
                        "targets": ["Linear"],
                        "weights": {"num_bits": 8, "type": "int", "strategy": "channel"},
                        "input_activations": {"num_bits": 8, "type": "int", "dynamic": True},
                    }
                },
            },
            r"compressed-tensors int8 channel \(activations quantized\) is not supported",
        ),
        ({**W4A16, "config_groups": {}}, "with 0 weight schemes"),
    ],
)
def test_formats_not_sized_are_named(config, words):
    with pytest.raises(UnsupportedQuantizationError, match=words):
        parse_quantization_config(config)


def test_tensor_parallel_shards_must_hold_whole_groups_and_blocks():
    """vLLM refuses a shard that splits a quantization group or block (e.g. Qwen3-30B-A3B's
    experts, 768 wide: 96 per rank at TP 8, not a multiple of 128)."""
    qwen = load("Qwen3-30B-A3B")
    block = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    fp8 = ModelShape.from_hf_config({**qwen, "quantization_config": block})
    check_tensor_parallel_size(fp8, 2)  # 384 per rank: 3 blocks
    with pytest.raises(ValueError) as caught:
        check_tensor_parallel_size(fp8, 8)
    assert str(caught.value) == (
        "fp8 float8, block 128x128: mlp.experts.0.gate_proj has 96 output channels per rank "
        "at tensor_parallel_size 8, not a multiple of 128"
    )
    awq = ModelShape.from_hf_config(
        {**qwen, "quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128}}
    )
    check_tensor_parallel_size(awq, 2)  # down_proj: 384 inputs per rank, 3 groups
    with pytest.raises(ValueError, match="down_proj has 192 input channels per rank at "):
        check_tensor_parallel_size(awq, 4)
