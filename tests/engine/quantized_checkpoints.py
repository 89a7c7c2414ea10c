"""Quantized checkpoints of a tiny Llama, made here, and their dequantized twins.

compressed-tensors checkpoints are made by the ``compressed-tensors`` library itself (its
``apply_quantization_config``, ``calculate_qparams`` and ``ModelCompressor``: what
llm-compressor calls, without its calibration); AWQ ones are packed by AutoAWQ's
``WQLinear_GEMM.from_linear``. GPTQ and vLLM ``fp8`` (per-tensor, and DeepSeek-V3-style
128x128 blocks) are written here following their documented layouts (GPTQModel does not
install beside our torch pin). Each maker also returns the dense weights its quantized values
stand for, computed from the quantization itself (not by unpacking), for the "dequantized
model" reference.
"""

from __future__ import annotations

import json
import pathlib
import shutil

import torch
import transformers
from safetensors.torch import save_file

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# A tiny Llama whose sizes fit 128-feature groups and blocks (tests/conftest.py TINY_CONFIG
# otherwise); initializer_range 0.1 makes the logits peaked enough that greedy tokens are
# decided by clear margins.
QUANT_MODEL = dict(
    hidden_size=256,
    intermediate_size=512,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    initializer_range=0.1,
)


def _linears(model: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    return {
        f"model.layers.{i}.{part}.{name}": getattr(getattr(layer, part), name)
        for i, layer in enumerate(model.model.layers)
        for part, names in (("self_attn", PROJECTIONS[:4]), ("mlp", PROJECTIONS[4:]))
        for name in names
    }


def _copy_side_files(base: pathlib.Path, out: pathlib.Path) -> None:
    for path in base.iterdir():
        if path.suffix != ".safetensors" and path.name != "config.json" and path.is_file():
            shutil.copy(path, out / path.name)


def _save(base: pathlib.Path, out: pathlib.Path, tensors: dict, quant_config: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, out / "model.safetensors")
    config = json.loads((base / "config.json").read_text())
    config["quantization_config"] = quant_config
    (out / "config.json").write_text(json.dumps(config, indent=2))
    _copy_side_files(base, out)


def save_dense(base: pathlib.Path, out: pathlib.Path, dense: dict[str, torch.Tensor]) -> None:
    """The base checkpoint with the linear weights replaced by ``dense`` (module -> [N, K])."""
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    for name, linear in _linears(model).items():
        linear.weight.data.copy_(dense[name])
    model.save_pretrained(out)
    _copy_side_files(base, out)


def compressed_tensors_checkpoint(
    base: pathlib.Path, out: pathlib.Path, scheme: dict, fmt: str
) -> tuple[pathlib.Path, dict[str, torch.Tensor]]:
    """``base`` quantized by compressed-tensors with ``scheme`` (QuantizationScheme fields:
    ``weights``, ``input_activations``) on every decoder Linear, ``lm_head`` ignored,
    min-max scales, saved compressed in ``fmt``. Returns ``(folder, dense weights)``, the
    latter by compressed-tensors' own ``fake_quantize``."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], **scheme)},
        ignore=["lm_head"],
    )
    apply_quantization_config(model, config)
    dense = {}
    for name, linear in _linears(model).items():
        args = linear.quantization_scheme.weights
        w = linear.weight.data
        if args.strategy == "channel":
            low, high = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
        elif args.strategy == "group":
            grouped = w.unflatten(-1, (-1, args.group_size))
            low, high = grouped.amin(-1), grouped.amax(-1)
        elif args.strategy == "block":
            bn, bk = args.block_structure
            blocks = w.unflatten(1, (-1, bk)).unflatten(0, (-1, bn))
            low, high = blocks.amin(dim=(1, 3)), blocks.amax(dim=(1, 3))
        else:
            low, high = w.amin(), w.amax()
        scale, zero_point = calculate_qparams(low, high, args)
        linear.weight_scale.data.copy_(scale.reshape(linear.weight_scale.shape))
        if hasattr(linear, "weight_zero_point"):
            linear.weight_zero_point.data.copy_(zero_point.reshape(linear.weight_zero_point.shape))
        zp = getattr(linear, "weight_zero_point", None)
        dense[name] = fake_quantize(w, linear.weight_scale.data, zp, args)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(out)
    _copy_side_files(base, out)
    return out, dense


def _int4_minmax(w: torch.Tensor, group: int):
    """AWQ's ``pseudo_quantize_tensor``: asymmetric 4-bit min-max per group of inputs.

    Returns ``(q [N, K] int, scales [N, K / G], zeros [N, K / G] int)``."""
    grouped = w.unflatten(-1, (-1, group))
    low, high = grouped.amin(-1), grouped.amax(-1)
    scales = ((high - low).clamp(min=1e-5) / 15).half().float()
    zeros = (-torch.round(low / scales)).clamp(0, 15)
    q = (torch.round(grouped / scales.unsqueeze(-1)) + zeros.unsqueeze(-1)).clamp(0, 15)
    return q.flatten(-2).int(), scales, zeros.int()


def awq_checkpoint(base: pathlib.Path, out: pathlib.Path, group: int = 128):
    """``base`` in AWQ GEMM packing by AutoAWQ. Returns ``(folder, dense weights)``."""
    from awq.modules.linear.gemm import WQLinear_GEMM

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    tensors = {k: v for k, v in model.state_dict().items() if not k.endswith("_proj.weight")}
    tensors.pop("lm_head.weight", None)
    dense = {}
    for name, linear in _linears(model).items():
        q, scales, zeros = _int4_minmax(linear.weight.data, group)
        groups = torch.arange(q.shape[1]) // group
        dense[name] = (q - zeros[:, groups]).float() * scales[:, groups]
        # AutoAWQ rounds ``(w + z s) / s`` itself: from the dequantized weight that is q.
        linear.weight.data.copy_(dense[name])
        packed = WQLinear_GEMM.from_linear(
            linear, 4, group, scales=scales.t().contiguous(), zeros=zeros.t().contiguous()
        )
        for key in ("qweight", "qzeros", "scales"):
            tensors[f"{name}.{key}"] = getattr(packed, key).cpu()
    quant = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True}
    _save(base, out, tensors, {**quant, "version": "gemm", "modules_to_not_convert": None})
    return out, dense


def _pack_rows(values: torch.Tensor) -> torch.Tensor:
    """``[R, 8 W]`` values 0..15 -> ``[R, W]`` int32, value ``8 w + i`` in bits ``[4i, ...)``."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    return (values.int().view(values.shape[0], -1, 8) << shifts).sum(-1, dtype=torch.int32)


def gptq_checkpoint(
    base: pathlib.Path, out: pathlib.Path, group: int = 128, desc_act: bool = False
):
    """``base`` in GPTQ's v1 layout (AutoGPTQ's ``QuantLinear.pack``): ``qweight`` packed along
    the input, ``qzeros`` along the output and stored minus one, ``g_idx``; with ``desc_act``
    the input features are grouped in a random order (as act-order's Hessian order would),
    one order per input: q/k/v share theirs, as gate/up do (the same activations give GPTQ the
    same Hessian). Returns ``(folder, dense weights)``."""
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    tensors = {k: v for k, v in model.state_dict().items() if not k.endswith("_proj.weight")}
    tensors.pop("lm_head.weight", None)
    dense = {}
    generator = torch.Generator().manual_seed(0)
    orders: dict[str, torch.Tensor] = {}
    for name, linear in _linears(model).items():
        w = linear.weight.data
        k = w.shape[1]
        key = name.replace("k_proj", "q_proj").replace("v_proj", "q_proj")
        key = key.replace("up_proj", "gate_proj")
        if key not in orders:
            orders[key] = torch.randperm(k, generator=generator) if desc_act else torch.arange(k)
        order = orders[key]
        g_idx = torch.empty(k, dtype=torch.int32)
        g_idx[order] = torch.arange(k, dtype=torch.int32) // group
        # Quantize in ``order``: consecutive groups of the permuted columns.
        q_perm, scales, zeros = _int4_minmax(w[:, order], group)
        q = torch.empty_like(q_perm)
        q[:, order] = q_perm
        dense[name] = (q - zeros[:, g_idx.long()]).float() * scales[:, g_idx.long()]
        tensors[f"{name}.qweight"] = _pack_rows(q).t().contiguous()
        tensors[f"{name}.qzeros"] = _pack_rows(((zeros - 1) & 0xF).t().contiguous())
        tensors[f"{name}.scales"] = scales.t().contiguous().half()
        tensors[f"{name}.g_idx"] = g_idx
    quant = {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": desc_act}
    _save(base, out, tensors, {**quant, "sym": False, "checkpoint_format": "gptq"})
    return out, dense


def fp8_checkpoint(
    base: pathlib.Path, out: pathlib.Path, block: list[int] | None, input_scale: float | None = None
):
    """``base`` in vLLM's ``fp8`` format: per-tensor ``weight_scale`` (``block`` None) or
    DeepSeek-V3's block-wise ``weight_scale_inv`` for ``weight_block_size`` ``block``, dynamic
    activations, or static ones with ``input_scale`` on every layer (per-tensor only).
    Returns ``(folder, dense weights)``."""
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    tensors = {k: v for k, v in model.state_dict().items() if not k.endswith("_proj.weight")}
    tensors.pop("lm_head.weight", None)
    dense = {}
    for name, linear in _linears(model).items():
        w = linear.weight.data
        if block is None:
            scale = w.abs().amax() / FP8_MAX
            q = (w / scale).to(FP8)
            dense[name] = q.float() * scale
            tensors[f"{name}.weight_scale"] = scale.reshape(())
            if input_scale is not None:
                tensors[f"{name}.input_scale"] = torch.tensor(input_scale)
        else:
            bn, bk = block
            blocks = w.unflatten(1, (-1, bk)).unflatten(0, (-1, bn))  # [Nb, bn, Kb, bk]
            scale = blocks.abs().amax(dim=(1, 3)) / FP8_MAX
            expanded = scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)
            q = (w / expanded).to(FP8)
            dense[name] = q.float() * expanded
            tensors[f"{name}.weight_scale_inv"] = scale
        tensors[f"{name}.weight"] = q
    scheme = "dynamic" if input_scale is None else "static"
    quant = {"quant_method": "fp8", "activation_scheme": scheme}
    if block is not None:
        quant["weight_block_size"] = block
    _save(base, out, tensors, quant)
    return out, dense
