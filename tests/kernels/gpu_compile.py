"""Compile, for an NVIDIA GPU, exactly the kernel launches the wrappers make; no GPU needed.

The interpreter runs kernels without compiling them, so it misses what only a GPU compile
rejects (``tl.dot`` operands under 16, a loop-carried value changing type, shared memory over
the device's limit). This script calls each public wrapper on host tensors at real model
shapes with the Triton kernels replaced by recorders, then compiles every recorded launch with
Triton's own toolchain (ptxas ships in the wheel) for the target architecture.

Run as a script with ``TRITON_INTERPRET=0`` (under the interpreter ``@triton.jit`` yields
functions the compiler cannot read); prints one JSON object per launch on stdout:
``{"kernel", "case", "ok", "error", "shared_bytes", "registers", "spill_bytes"}`` (per-thread
registers and spilled bytes as ``ptxas -v`` reports them). Usage:
``python tests/kernels/gpu_compile.py [compute_capability, default 90]``.
"""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability
from triton.compiler import ASTSource

from kvpilot.kernels import activation, reshape_and_cache, rms_norm, rotary_embedding
from kvpilot.kernels import unified_attention as attention

_POINTER_TYPES = {
    torch.bfloat16: "*bf16",
    torch.float16: "*fp16",
    torch.float32: "*fp32",
    torch.int32: "*i32",
    torch.int64: "*i64",
    torch.uint8: "*u8",
    torch.float8_e4m3fn: "*fp8e4nv",
    torch.float8_e5m2: "*fp8e5",
}
# The fp8 formats compile from these architectures on (fp8e4nv from Ada/Hopper, fp8e5 from
# Ampere); the engine refuses each with the Triton backend below them (model_loader/dtype.py).
E4M3_MIN_CAPABILITY = 89
E5M2_MIN_CAPABILITY = 80


class _Recorder:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](*args, **kwargs)`` is recorded."""

    def __init__(self, fn: triton.runtime.jit.JITFunction) -> None:
        self.fn = fn
        self.launches: list[tuple[tuple, dict]] = []

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
        def launch(*args: object, **kwargs: object) -> None:
            self.launches.append((args, kwargs))

        return launch


def _arg_type(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return _POINTER_TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {type(value).__name__}")


def compile_launch(
    fn: triton.runtime.jit.JITFunction, args: tuple, kwargs: dict, capability: int
) -> dict:
    """Compile one recorded launch for ``cuda:<capability>``; returns the compiled metadata."""
    options = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
    bound = dict(zip(fn.arg_names, args, strict=False))
    bound.update({k: v for k, v in kwargs.items() if k not in options})
    signature, constexprs, attrs = {}, {}, {}
    for index, param in enumerate(fn.params):
        value = bound[param.name]
        # Specialise as Triton's launcher does: integers equal to 1 become constants, and
        # 16-divisible integers and 16-aligned pointers are marked so (vectorised accesses).
        if param.is_constexpr or (type(value) is int and value == 1):
            signature[param.name] = "constexpr"
            constexprs[param.name] = value
            continue
        signature[param.name] = _arg_type(value)
        aligned = value.data_ptr() % 16 == 0 if isinstance(value, torch.Tensor) else None
        if aligned or (type(value) is int and value % 16 == 0):
            attrs[(index,)] = [["tt.divisibility", 16]]
    compiled = triton.compile(
        ASTSource(fn, signature, constexprs, attrs),
        target=GPUTarget("cuda", capability, 32),
        options=options,
    )
    return {
        "shared_bytes": compiled.metadata.shared,
        **_ptxas_usage(compiled.asm["ptx"], capability),
    }


def _ptxas_usage(ptx: str, capability: int) -> dict:
    """Registers per thread and spilled bytes that ``ptxas -v`` reports for ``ptx``."""
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "kernel.ptx"
        path.write_text(ptx)
        done = subprocess.run(
            [get_ptxas(capability).path, "-v", "--gpu-name", sm_arch_from_capability(capability),
             str(path), "-o", str(path.with_suffix(".cubin"))],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
    registers = re.search(r"Used (\d+) registers", done.stderr)
    spills = re.findall(r"(\d+) bytes spill (?:stores|loads)", done.stderr)
    return {
        "registers": int(registers.group(1)) if registers else -1,
        "spill_bytes": sum(int(n) for n in spills),
    }


def _cases(capability: int) -> list[tuple[str, Callable[[], None]]]:
    """(name, call) pairs covering the wrappers' launch configurations at real model shapes;
    the fp8 KV cache's only where ``capability`` has fp8 conversions."""
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2

    def attention_case(
        dtype: torch.dtype,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        q_lens: list[int],
        cache_dtype: torch.dtype | None = None,
        **kwargs: object,
    ) -> Callable[[], None]:
        def run() -> None:
            block_size, blocks_per_seq = 16, 8
            num_seqs = len(q_lens)
            cache = torch.zeros(
                num_seqs * blocks_per_seq, block_size, num_kv_heads, head_dim,
                dtype=cache_dtype or dtype,
            )  # fmt: skip
            if cache_dtype is not None:
                kwargs.update(k_scale=torch.ones(()), v_scale=torch.ones(()))
            qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
            attention.unified_attention(
                torch.zeros(int(qsl[-1]), num_heads, head_dim, dtype=dtype),
                cache,
                cache,
                query_start_loc=qsl,
                seq_lens=torch.full((num_seqs,), block_size * blocks_per_seq, dtype=torch.int32),
                block_tables=torch.arange(num_seqs * blocks_per_seq, dtype=torch.int32).view(
                    num_seqs, -1
                ),
                scale=head_dim**-0.5,
                **kwargs,
            )

        return run

    def rope(is_neox: bool) -> None:
        q, k = torch.zeros(4, 32, 128, dtype=bf16), torch.zeros(4, 8, 128, dtype=bf16)
        rotary_embedding.rotary_embedding(torch.arange(4), q, k, torch.zeros(64, 128), is_neox)

    def cache_write(cache_dtype: torch.dtype = bf16) -> None:
        kv = torch.zeros(4, 8, 128, dtype=bf16)
        cache = torch.zeros(2, 16, 8, 128, dtype=cache_dtype)
        scales = (torch.ones(()), torch.ones(())) if cache_dtype != bf16 else (None, None)
        reshape_and_cache.reshape_and_cache(kv, kv, cache, cache, torch.arange(4), *scales)

    x = torch.zeros(4, 4096, dtype=bf16)
    gemma_x = torch.zeros(4, 3072, dtype=bf16)  # Gemma-7B: hidden 3072, intermediate 24576
    gemma_gate_up = torch.zeros(4, 2 * 24576, dtype=bf16)
    e4m3_cases = [
        (
            "attention llama3-8b bf16 fp8-e4m3 decode",
            attention_case(bf16, 32, 8, 128, [1, 1, 1, 1], e4m3),
        ),
        (
            "attention llama3-8b bf16 fp8-e4m3 decode split",
            attention_case(bf16, 32, 8, 128, [1, 1], e4m3, num_kv_splits=8),
        ),
        (
            "attention llama3-8b bf16 fp8-e4m3 mixed",
            attention_case(bf16, 32, 8, 128, [1, 40, 7], e4m3),
        ),
        ("reshape_and_cache bf16 fp8-e4m3", lambda: cache_write(e4m3)),
    ]
    e5m2_cases = [
        (
            "attention llama3-8b fp16 fp8-e5m2 mixed",
            attention_case(fp16, 32, 8, 128, [1, 40], e5m2),
        ),
        ("reshape_and_cache bf16 fp8-e5m2", lambda: cache_write(e5m2)),
    ]
    fp8_cases = (e4m3_cases if capability >= E4M3_MIN_CAPABILITY else []) + (
        e5m2_cases if capability >= E5M2_MIN_CAPABILITY else []
    )
    return fp8_cases + [
        ("attention llama3-8b bf16 decode", attention_case(bf16, 32, 8, 128, [1, 1, 1, 1])),
        (
            "attention llama3-8b bf16 decode split",
            attention_case(bf16, 32, 8, 128, [1, 1], num_kv_splits=8),
        ),
        ("attention llama3-8b bf16 mixed", attention_case(bf16, 32, 8, 128, [1, 40, 7])),
        (
            "attention llama3-8b fp16 sliding",
            attention_case(fp16, 32, 8, 128, [1, 40], sliding_window=64),
        ),
        ("attention smollm2 fp32 mixed", attention_case(fp32, 9, 3, 64, [1, 40])),
        ("attention llama3-8b fp32 decode", attention_case(fp32, 32, 8, 128, [1, 1])),
        ("attention gemma3 bf16 head_dim 256", attention_case(bf16, 4, 1, 256, [1, 40])),
        ("reshape_and_cache bf16", cache_write),
        ("rms_norm bf16 residual", lambda: rms_norm.rms_norm(x, x[0], 1e-5, x)),
        (
            "rms_norm gemma bf16",
            lambda: rms_norm.rms_norm(gemma_x, gemma_x[0], 1e-6, weight_offset=1.0),
        ),
        (
            "rms_norm gemma bf16 residual",
            lambda: rms_norm.rms_norm(gemma_x, gemma_x[0], 1e-6, gemma_x, weight_offset=1.0),
        ),
        ("rotary_embedding neox", lambda: rope(True)),
        ("rotary_embedding gptj", lambda: rope(False)),
        (
            "silu_and_mul bf16",
            lambda: activation.silu_and_mul(torch.zeros(4, 2 * 14336, dtype=bf16)),
        ),
        ("gelu_and_mul tanh gemma bf16", lambda: activation.gelu_and_mul(gemma_gate_up, "tanh")),
        ("gelu_and_mul exact gemma bf16", lambda: activation.gelu_and_mul(gemma_gate_up)),
    ]


def main(capability: int) -> None:
    modules = [activation, reshape_and_cache, rms_norm, rotary_embedding, attention]
    recorders = {
        (module, name): _Recorder(getattr(module, name))
        for module in modules
        for name in dir(module)
        if isinstance(getattr(module, name), triton.runtime.jit.JITFunction)
        and name.endswith("_kernel")
    }
    for (module, name), recorder in recorders.items():
        setattr(module, name, recorder)
    compile_recorded(
        _cases(capability), {name: rec for (_, name), rec in recorders.items()}, capability
    )


def compile_recorded(cases, recorders: dict, capability: int) -> None:
    """Run each ``(case, call)``, then compile every launch the ``recorders`` (kernel name ->
    recorder) captured for ``capability`` and print one JSON line per launch."""
    for case, call in cases:
        call()
        for name, recorder in recorders.items():
            for args, kwargs in recorder.launches:
                result = {"kernel": name, "case": case, "ok": True, "error": ""}
                result.update(shared_bytes=0, registers=-1, spill_bytes=0)
                try:
                    result.update(compile_launch(recorder.fn, args, kwargs, capability))
                except Exception as exc:  # report every failure, keep compiling the rest
                    result.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:2000])
                print(json.dumps(result), flush=True)
            recorder.launches.clear()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 90)
