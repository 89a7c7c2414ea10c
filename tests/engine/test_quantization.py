"""Quantized checkpoints (made here, see ``quantized_checkpoints``) through our model and the
engine, against transformers.

compressed-tensors checkpoints run in transformers on the CPU (it decompresses the weights and
fake-quantizes activations as the scheme says): logits must match to float32 rounding, greedy
tokens exactly; but transformers 5.24 cannot load asymmetric ``pack-quantized`` zero points
(it expects them unpacked), so that scheme is checked against the weights compressed-tensors'
``fake_quantize`` gives, as the int4 formats below. AWQ, GPTQ and vLLM ``fp8`` checkpoints do not run in transformers here: they
are checked against transformers on the dequantized weights, to float32 rounding for the
weight-only int4 formats and within ``FP8_ACTIVATION_RTOL`` for fp8, whose activations the
engine quantizes (as vLLM does) and the dequantized model does not.
"""

from __future__ import annotations

import argparse
import json
import pathlib

import pytest
import torch
import transformers

from kvpilot.engine import LLM
from kvpilot.engine.config import EngineArgs
from kvpilot.engine.layers.quantization import get_quantization_config
from kvpilot.engine.model_loader import load_model
from kvpilot.engine.model_shape import ModelShape
from kvpilot.kernels.cpu import paged_attention
from tests.engine.helpers import generate_ids, greedy, hf_generate
from tests.engine.quantized_checkpoints import (
    QUANT_MODEL,
    awq_checkpoint,
    compressed_tensors_checkpoint,
    fp8_checkpoint,
    gptq_checkpoint,
    save_dense,
)
from tests.engine.test_models import PROMPT_A, PROMPT_B, PagedBatch, hf_logits

# Logits of the quantized and the reference model, relative to the largest logit.
FLOAT32_RTOL = 1e-5
# fp8 activations (3 mantissa bits, one scale per token or tensor) against unquantized ones:
# measured 0.14-0.17 on this random 2-layer model (weights alone: 2e-6).
FP8_ACTIVATION_RTOL = 0.25
NEW_TOKENS = 8

_FP8 = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False}
_FP8_TOKEN = {
    "num_bits": 8,
    "type": "float",
    "symmetric": True,
    "dynamic": True,
    "strategy": "token",
}
_INT4 = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}
CT_SCHEMES = {
    "fp8-channel-dynamic-token": (
        {"weights": {**_FP8, "strategy": "channel"}, "input_activations": _FP8_TOKEN},
        "float-quantized",
    ),
    "fp8-channel-weight-only": ({"weights": {**_FP8, "strategy": "channel"}}, "float-quantized"),
    "fp8-tensor-dynamic-token": (
        {"weights": {**_FP8, "strategy": "tensor"}, "input_activations": _FP8_TOKEN},
        "float-quantized",
    ),
    "fp8-block-128-dynamic-group": (
        {
            "weights": {**_FP8, "strategy": "block", "block_structure": [128, 128]},
            "input_activations": {**_FP8_TOKEN, "strategy": "group", "group_size": 128},
        },
        "float-quantized",
    ),
    "w4a16-group-128-symmetric": ({"weights": {**_INT4, "symmetric": True}}, "pack-quantized"),
    "w4a16-group-128-asymmetric": ({"weights": {**_INT4, "symmetric": False}}, "pack-quantized"),
}


@pytest.fixture(autouse=True)
def attention_as_transformers_computes_it(monkeypatch):
    """Our attention by its reference path (gather + SDPA, the calls transformers makes), so
    that these comparisons measure the quantized linear layers alone. Activations quantized to
    fp8 turn a last-bit difference in attention (the CPU kernel sums in another order, within
    1e-6 of SDPA: tests/kernels/test_cpu_paged_attention.py) into a whole fp8 step now and then,
    about 1% of a logit here, far above the float32 rounding these tests hold the weights to."""
    monkeypatch.setenv(paged_attention.ENV_VAR, "0")


@pytest.fixture(scope="module")
def base_dir(tiny_model_dir) -> pathlib.Path:
    return tiny_model_dir("llama", **QUANT_MODEL)


def _max_relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got - expected).abs().max() / expected.abs().max())


def _paged_logits(model: torch.nn.Module) -> torch.Tensor:
    """Prefill of two prompts in one batch, then one decode step of each: logits of every
    new token, ``[len(A) + len(B) + 2, vocab]``."""
    batch = PagedBatch(model)
    prefill = batch.forward(model, [("a", PROMPT_A), ("b", PROMPT_B)])
    decode = batch.forward(model, [("a", [PROMPT_B[3]]), ("b", [PROMPT_A[5]])])
    return torch.cat([prefill, decode])


def _hf_paged_logits(model: torch.nn.Module) -> torch.Tensor:
    a = hf_logits(model, [*PROMPT_A, PROMPT_B[3]])
    b = hf_logits(model, [*PROMPT_B, PROMPT_A[5]])
    return torch.cat([a[:-1], b[:-1], a[-1:], b[-1:]])


def _ours(folder: pathlib.Path) -> torch.nn.Module:
    return load_model(folder, torch.float32, torch.device("cpu"))


def _hf(folder: pathlib.Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _engine_greedy(folder: pathlib.Path, tp: int = 1, **kwargs) -> list[list[int]]:
    llm = LLM(
        str(folder),
        dtype="float32",
        max_model_len=64,
        tensor_parallel_size=tp,
        enable_prefix_caching=False,
        **kwargs,
    )
    try:
        return generate_ids(llm, [PROMPT_A, PROMPT_B], greedy(NEW_TOKENS))
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize("scheme", list(CT_SCHEMES))
def test_compressed_tensors_logits_match_transformers(base_dir, tmp_path, scheme):
    args, fmt = CT_SCHEMES[scheme]
    folder, dense = compressed_tensors_checkpoint(base_dir, tmp_path / "ct", args, fmt)
    ours = _ours(folder)
    layer = ours.model.layers[0]
    assert type(layer.self_attn.qkv_proj.quant_method).__name__.startswith("CompressedTensors")
    # The checkpoint ignores lm_head (tied to the embedding): it stays float32.
    assert ours.lm_head.weight.dtype == torch.float32
    got = _paged_logits(ours)
    if scheme.endswith("asymmetric"):
        save_dense(base_dir, tmp_path / "dense", dense)
        folder = tmp_path / "dense"
    expected = _hf_paged_logits(_hf(folder))
    assert _max_relative_error(got, expected) < FLOAT32_RTOL


def test_compressed_tensors_greedy_tokens_match_transformers(base_dir, tmp_path):
    args, fmt = CT_SCHEMES["w4a16-group-128-symmetric"]
    folder, _ = compressed_tensors_checkpoint(base_dir, tmp_path / "ct", args, fmt)
    hf = _hf(folder)
    expected = [hf_generate(hf, p, NEW_TOKENS) for p in (PROMPT_A, PROMPT_B)]
    assert _engine_greedy(folder) == expected


@pytest.mark.parametrize("maker", ["awq", "gptq-qwen2", "gptq-desc-act"])
def test_int4_checkpoints_match_the_dequantized_model(base_dir, tiny_model_dir, tmp_path, maker):
    if maker.endswith("qwen2"):
        # Qwen2's q/k/v biases stay float beside the packed weights.
        base_dir = tiny_model_dir("qwen2", **QUANT_MODEL)
    if maker == "awq":
        folder, dense = awq_checkpoint(base_dir, tmp_path / "q")
    else:
        folder, dense = gptq_checkpoint(base_dir, tmp_path / "q", desc_act=maker.endswith("act"))
    save_dense(base_dir, tmp_path / "dense", dense)
    ours = _ours(folder)
    # The linear layers hold 4 bits a weight (and a scale and zero per 128): about 1/8 of fp32.
    linear_bytes = sum(
        p.nbytes for n, p in ours.named_parameters() if "_proj" in n and "bias" not in n
    )
    assert linear_bytes < 0.15 * 4 * sum(w.numel() for w in dense.values())
    got = _paged_logits(ours)
    hf_dense = _hf(tmp_path / "dense")
    assert _max_relative_error(got, _hf_paged_logits(hf_dense)) < FLOAT32_RTOL
    if maker == "awq":
        expected = [hf_generate(hf_dense, p, NEW_TOKENS) for p in (PROMPT_A, PROMPT_B)]
        assert _engine_greedy(folder) == expected


@pytest.mark.parametrize("block", [None, [128, 128]], ids=["per-tensor", "block-128"])
def test_fp8_checkpoints_match_the_dequantized_model(base_dir, tmp_path, block):
    folder, dense = fp8_checkpoint(base_dir, tmp_path / "q", block)
    save_dense(base_dir, tmp_path / "dense", dense)
    ours = _ours(folder)
    assert ours.model.layers[1].mlp.down_proj.weight.dtype == torch.float8_e4m3fn
    hf_dense = _hf(tmp_path / "dense")
    error = _max_relative_error(_paged_logits(ours), _hf_paged_logits(hf_dense))
    assert error < FP8_ACTIVATION_RTOL
    if block is not None:
        # transformers runs this format itself on the CPU, dequantized: the same weights.
        torch.testing.assert_close(_hf_paged_logits(_hf(folder)), _hf_paged_logits(hf_dense))
        # The same weight blocks and 1x128 activation groups as compressed-tensors' FP8_BLOCK,
        # which transformers runs with its activation quantization: equal to rounding.
        args, fmt = CT_SCHEMES["fp8-block-128-dynamic-group"]
        ct, _ = compressed_tensors_checkpoint(base_dir, tmp_path / "ct", args, fmt)
        hf_ct = _hf(ct)
        assert _max_relative_error(_paged_logits(ours), _hf_paged_logits(hf_ct)) < FLOAT32_RTOL
        expected = [hf_generate(hf_ct, p, NEW_TOKENS) for p in (PROMPT_A, PROMPT_B)]
        assert _engine_greedy(folder) == expected


def test_fp8_static_activation_scales(base_dir, tmp_path):
    # One static scale for every layer's input, large enough for this model's activations.
    folder, dense = fp8_checkpoint(base_dir, tmp_path / "q", None, input_scale=0.05)
    save_dense(base_dir, tmp_path / "dense", dense)
    ours = _ours(folder)
    assert float(ours.model.layers[0].self_attn.qkv_proj.input_scale) == pytest.approx(0.05)
    error = _max_relative_error(_paged_logits(ours), _hf_paged_logits(_hf(tmp_path / "dense")))
    assert 0 < error < FP8_ACTIVATION_RTOL


def test_fp8_quantizes_an_unquantized_checkpoint_while_loading(base_dir):
    ours = load_model(base_dir, torch.float32, torch.device("cpu"), quantization="fp8")
    assert ours.model.layers[0].self_attn.o_proj.weight.dtype == torch.float8_e4m3fn
    error = _max_relative_error(_paged_logits(ours), _hf_paged_logits(_hf(base_dir)))
    assert 0 < error < FP8_ACTIVATION_RTOL


def test_dummy_weights_quantize_online_and_refuse_a_stored_quantized_format(base_dir, tmp_path):
    """``--load-format dummy`` with ``--quantization fp8`` quantizes the random weights as it
    would a checkpoint's; a checkpoint stored quantized cannot be stood in for."""
    cpu = torch.device("cpu")
    ours = load_model(base_dir, torch.float32, cpu, quantization="fp8", load_format="dummy")
    weight = ours.model.layers[0].self_attn.o_proj.weight
    assert weight.dtype == torch.float8_e4m3fn and weight.float().abs().max() > 0
    folder, _ = fp8_checkpoint(base_dir, tmp_path / "q", None)
    with pytest.raises(ValueError, match="stored quantized .*float8_e4m3fn"):
        load_model(folder, torch.float32, cpu, load_format="dummy")


# Dynamic per-token fp8 activations are not in this test: a row-parallel rank quantizes its
# own slice of the features (as vLLM's ranks do), so the scales, and the rounding, differ from
# one rank's.
@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["w4a16-group-128-asymmetric", "fp8-channel-weight-only"])
def test_two_ranks_match_one_on_quantized_checkpoints(base_dir, tmp_path, scheme):
    args, fmt = CT_SCHEMES[scheme]
    folder, _ = compressed_tensors_checkpoint(base_dir, tmp_path / "ct", args, fmt)
    assert _engine_greedy(folder, tp=2) == _engine_greedy(folder, tp=1)


@pytest.mark.slow
def test_two_ranks_match_one_on_gptq_act_order(base_dir, tmp_path):
    # Act-order groups are scattered over the input: the row-parallel ranks keep every scale.
    folder, _ = gptq_checkpoint(base_dir, tmp_path / "q", desc_act=True)
    assert _engine_greedy(folder, tp=2) == _engine_greedy(folder, tp=1)


def _with_quant_config(base: pathlib.Path, out: pathlib.Path, quant: dict) -> pathlib.Path:
    out.mkdir()
    for path in base.iterdir():
        (out / path.name).write_bytes(path.read_bytes())
    config = json.loads((base / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
    return out


def test_a_quantization_config_string_or_upper_case_method_loads_as_the_method():
    awq = {"quant_method": "AWQ", "bits": 4, "group_size": 128}
    assert get_quantization_config(awq).get_name() == "awq"
    assert get_quantization_config(json.dumps(awq), "AWQ").get_name() == "awq"
    assert get_quantization_config("fp8").get_name() == "fp8"
    with pytest.raises(ValueError) as refused:
        get_quantization_config({"bits": 4})
    assert str(refused.value) == (
        "quantization_config has no quant_method: the quantization method is missing "
        "(the kvpilot engine loads fp8, compressed-tensors, awq, gptq)"
    )


def test_unsupported_formats_are_refused_by_name(base_dir, tmp_path):
    folder = _with_quant_config(base_dir, tmp_path / "bnb", {"quant_method": "bitsandbytes"})
    with pytest.raises(ValueError, match="quantization method 'bitsandbytes' is not supported"):
        load_model(folder, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="does not match the checkpoint's .* 'awq'"):
        get_quantization_config({"quant_method": "awq", "bits": 4, "group_size": 128}, "gptq")
    with pytest.raises(ValueError, match="awq: 3-bit weights are not supported"):
        get_quantization_config({"quant_method": "awq", "bits": 3, "group_size": 128})
    with pytest.raises(ValueError, match="only fp8 quantizes an unquantized checkpoint"):
        get_quantization_config(None, "awq")
    w8 = {"weights": {"num_bits": 8, "type": "int", "strategy": "channel"}}
    with pytest.raises(ValueError, match="scheme not supported .*int 8-bit channel"):
        get_quantization_config(
            {
                "quant_method": "compressed-tensors",
                "format": "pack-quantized",
                "config_groups": {"group_0": {"targets": ["Linear"], **w8}},
            }
        )
    with pytest.raises(ValueError, match="gptq: .* input features per rank, not a multiple"):
        load_model(
            _with_quant_config(
                base_dir, tmp_path / "g", {"quant_method": "gptq", "bits": 4, "group_size": 96}
            ),
            torch.float32,
            torch.device("cpu"),
        )


def test_lora_on_quantized_layers_is_refused(base_dir, tmp_path):
    args, fmt = CT_SCHEMES["w4a16-group-128-symmetric"]
    folder, _ = compressed_tensors_checkpoint(base_dir, tmp_path / "ct", args, fmt)
    with pytest.raises(ValueError, match="LoRA on quantized layers"):
        LLM(str(folder), dtype="float32", max_model_len=64, enable_lora=True)


def test_the_quantization_flag():
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = EngineArgs.from_cli_args(parser.parse_args(["--quantization", "compressed-tensors"]))
    assert args.quantization == "compressed-tensors"
    with pytest.raises(ValueError, match="quantization must be one of fp8, compressed-tensors"):
        EngineArgs(quantization="bitsandbytes")


def test_the_engine_accepts_the_formats_it_loads():
    config = json.loads(json.dumps(transformers.LlamaConfig(**QUANT_MODEL).to_dict()))
    config["architectures"] = ["LlamaForCausalLM"]
    awq = {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm"}
    w4a16 = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                    "group_size": 128,
                },
            }
        },
        "ignore": ["lm_head"],
    }  # fmt: skip
    bnb = {"quant_method": "bitsandbytes"}
    for quantization, supported in ((awq, True), (w4a16, True), (bnb, False)):
        config["quantization_config"] = quantization
        assert ModelShape.from_hf_config(config).is_supported_by_engine is supported
