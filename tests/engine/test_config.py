"""Engine arguments: vLLM flag spellings, validation naming the argument, ``kvpilot generate``."""

from __future__ import annotations

import argparse

import pytest

from kvpilot.cli import main
from kvpilot.engine.config import (
    CPU_BLOCK_SIZE,
    ENGINE_FLAGS,
    GPU_BLOCK_SIZE,
    EngineArgs,
    name_flags,
    parse_bytes,
    resolve_block_size,
)


def parse(argv: list[str]) -> EngineArgs:
    return EngineArgs.from_cli_args(
        EngineArgs.add_cli_args(argparse.ArgumentParser()).parse_args(argv)
    )


def test_flags_map_to_engine_args():
    args = parse(
        [
            "--model", "some/model", "--max-model-len", "1024", "--block-size", "32",
            "--max-num-seqs", "8", "--max-num-batched-tokens", "2048", "--kv-cache-memory", "1GiB",
            "--gpu-memory-utilization", "0.5", "--dtype", "float16", "--seed", "3",
            "--no-enable-prefix-caching", "--no-enable-chunked-prefill",
            "--long-prefill-token-threshold", "64", "--attention-backend", "torch",
        ]
    )  # fmt: skip
    assert args == EngineArgs(
        model="some/model",
        max_model_len=1024,
        block_size=32,
        max_num_seqs=8,
        max_num_batched_tokens=2048,
        kv_cache_memory=1024**3,
        gpu_memory_utilization=0.5,
        dtype="float16",
        seed=3,
        enable_prefix_caching=False,
        enable_chunked_prefill=False,
        long_prefill_token_threshold=64,
        attention_backend="torch",
    )
    defaults = parse([])
    assert defaults == EngineArgs()
    assert defaults.enable_prefix_caching and defaults.enable_chunked_prefill
    assert defaults.block_size is None  # the device's: 16 on a GPU, 8 on the CPU
    assert resolve_block_size(None, on_gpu=True) == GPU_BLOCK_SIZE == 16
    assert resolve_block_size(None, on_gpu=False) == CPU_BLOCK_SIZE == 8
    assert resolve_block_size(32, on_gpu=False) == 32


def test_vllm_loading_flags_map_to_engine_args(capsys):
    args = parse(
        [
            "--kv-cache-memory-bytes", "1GiB", "--tokenizer-mode", "hf",
            "--load-format", "dummy", "--hf-overrides", '{"max_position_embeddings": 64}',
        ]
    )  # fmt: skip
    assert args == EngineArgs(
        kv_cache_memory=1024**3,
        tokenizer_mode="hf",
        load_format="dummy",
        hf_overrides={"max_position_embeddings": 64},
    )
    args = parse(
        [
            "--override-generation-config", '{"temperature": 0.5}', "--num-gpu-blocks-override",
            "100", "--scheduling-policy", "priority", "--hf-token", "--tokenizer-revision", "v2",
            "--ignore-patterns", "original/*", "*.pth",
        ]
    )  # fmt: skip
    assert args == EngineArgs(
        override_generation_config={"temperature": 0.5},
        num_gpu_blocks_override=100,
        scheduling_policy="priority",
        hf_token=True,
        tokenizer_revision="v2",
        ignore_patterns=["original/*", "*.pth"],
    )
    assert parse(["--hf-token", "hf_x"]).hf_token == "hf_x"
    # vLLM's Python name of the KV budget is another name for kv_cache_memory.
    assert EngineArgs(kv_cache_memory_bytes=4096).kv_cache_memory == 4096
    assert EngineArgs(kv_cache_memory=4096, kv_cache_memory_bytes=4096).kv_cache_memory == 4096
    with pytest.raises(SystemExit):  # argparse says why
        parse(["--tokenizer-mode", "mistral"])
    assert "kvpilot reads every tokenizer with transformers" in capsys.readouterr().err
    assert parse(["--load-format", "gguf", "--model", "m.gguf"]).load_format == "gguf"


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"tokenizer_mode": "mistral"}, "tokenizer_mode"),
        ({"load_format": "pt"}, "load_format"),
        ({"load_format": "gguf", "model": "some/folder"}, "load_format"),
        ({"load_format": "safetensors", "model": "m.Q4_0.gguf"}, "load_format"),
        ({"hf_overrides": "[1]"}, "hf_overrides"),
        ({"hf_overrides": "{rope"}, "hf_overrides"),
        ({"kv_cache_memory": 1, "kv_cache_memory_bytes": 2}, "kv_cache_memory_bytes"),
        ({"kv_cache_memory_bytes": 0}, "kv_cache_memory_bytes"),
        ({"override_generation_config": "[]"}, "override_generation_config"),
        ({"override_generation_config": {"temperature": "hot"}}, "override_generation_config"),
        ({"override_generation_config": {"top_p": 5}}, "override_generation_config"),
        ({"override_generation_config": {"max_new_tokens": 0}}, "override_generation_config"),
        ({"num_gpu_blocks_override": 0}, "num_gpu_blocks_override"),
        ({"scheduling_policy": "lifo"}, "scheduling_policy"),
        ({"ignore_patterns": "*.bin"}, "ignore_patterns"),
        ({"hf_token": 5}, "hf_token"),
        ({"block_size": 0}, "block_size"),
        ({"max_model_len": -1}, "max_model_len"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_num_batched_tokens": 1.5}, "max_num_batched_tokens"),
        ({"kv_cache_memory": 0}, "kv_cache_memory"),
        ({"gpu_memory_utilization": 0.0}, "gpu_memory_utilization"),
        ({"dtype": "int8"}, "dtype"),
        ({"device": "tpu"}, "device"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
        ({"long_prefill_token_threshold": -5}, "long_prefill_token_threshold"),
        ({"attention_backend": "flash"}, "attention_backend"),
        (
            {
                "enable_chunked_prefill": False,
                "max_model_len": 4096,
                "max_num_batched_tokens": 2048,
            },
            "max_num_batched_tokens",
        ),
    ],
)
def test_bad_argument_is_named(kwargs, name):
    with pytest.raises(ValueError, match=f"^{name} "):
        EngineArgs(**kwargs)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["-pp", "0"], "--pipeline-parallel-size must be a positive integer, got 0"),
        (
            ["--calculate-kv-scales"],
            "--calculate-kv-scales needs an fp8 KV cache: set --kv-cache-dtype to fp8 "
            "(it is 'auto')",
        ),
        (["--lora-modules", "a=b"], "--lora-modules needs --enable-lora, got ['a=b']"),
        (
            ["--enable-lora", "-tp", "2"],
            "--enable-lora is not supported with --tensor-parallel-size > 1 yet",
        ),
    ],
)
def test_a_bad_flag_is_named_as_the_flag(argv, message):
    with pytest.raises(ValueError) as refused:
        parse(argv)
    assert str(refused.value) == message


def test_a_bad_argument_of_the_python_api_is_named_as_the_field():
    with pytest.raises(ValueError) as refused:
        EngineArgs(calculate_kv_scales=True)
    assert str(refused.value) == (
        "calculate_kv_scales needs an fp8 KV cache: set kv_cache_dtype to fp8 (it is 'auto')"
    )


def test_name_flags_rewrites_whole_argument_names_only():
    message = (
        "max_model_len 9 exceeds the model's max_position_embeddings; see generation_config.json"
        ' in /m/max_model_len; --max-model-len; a JSON key "max_model_len"'
    )
    assert name_flags(message, ENGINE_FLAGS) == (
        "--max-model-len 9 exceeds the model's max_position_embeddings; see "
        'generation_config.json in /m/max_model_len; --max-model-len; a JSON key "max_model_len"'
    )


def test_a_bad_memory_size_flag_says_what_a_size_is(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--prompt", "x", "--kv-cache-memory", "lots"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "kvpilot generate: error: argument --kv-cache-memory/--kv-cache-memory-bytes: not a "
        "memory size: 'lots' (examples: 1073741824, 1GiB, 512MB)"
    )


def test_parse_bytes():
    assert parse_bytes("1073741824") == 1024**3
    assert parse_bytes("512MiB") == 512 * 1024**2
    assert parse_bytes("2GB") == 2 * 1000**3
    with pytest.raises(ValueError, match="not a memory size"):
        parse_bytes("lots")


def test_generate_cli_prints_completions(tiny_model_dir, capsys):
    model = str(tiny_model_dir("llama"))
    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                "generate", "--model", model, "--prompt", "Hello", "--prompt", "Bye",
                "--max-tokens", "5", "--max-model-len", "64", "--ignore-eos",
            ]
        )  # fmt: skip
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.count("### Output (5 tokens, length):") == 2
    assert "### Prompt: Hello" in out and "### Prompt: Bye" in out


def test_generate_cli_reports_a_bad_argument(tiny_model_dir, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                "generate",
                "--model",
                str(tiny_model_dir("llama")),
                "--prompt",
                "x",
                "--max-tokens",
                "0",
            ]
        )
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "kvpilot generate: error: --max-tokens must be at least 1, got 0"
    )


def test_generate_cli_reports_a_model_it_cannot_find(tmp_path, capsys):
    missing = tmp_path / "no-such-model"
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--model", str(missing), "--prompt", "x"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1].startswith("kvpilot generate: error: model ")
    assert str(missing) in err and "Traceback" not in err
    assert "Loading" not in err  # no progress bar before the error


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--max-model-len", "100000"],
            "--max-model-len 100000 exceeds the model's max_position_embeddings ({max_len})",
        ),
        (
            ["--generation-config", "{tmp}"],
            "--generation-config: {tmp}/generation_config.json does not exist",
        ),
        (
            ["--kv-cache-memory", "1"],
            "no room for a single KV block ({block} bytes) with --kv-cache-memory 1 bytes; "
            "raise --kv-cache-memory / --gpu-memory-utilization",
        ),
    ],
    ids=["max-model-len", "generation-config", "kv-cache-memory"],
)
def test_generate_cli_refuses_what_the_model_config_rules_out_before_loading(
    tiny_model_dir, tmp_path, capsys, argv, message
):
    """Checked against config.json before the progress bar and the weights: one line."""
    import json

    from kvpilot.engine.model_shape import ModelShape

    model = tiny_model_dir("llama")
    config = json.loads((model / "config.json").read_text())
    block = ModelShape.from_hf_config(config).kv_bytes_per_token(4) * CPU_BLOCK_SIZE
    argv = [a.format(tmp=tmp_path) for a in argv]
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--model", str(model), "--prompt", "x", "--device", "cpu", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Loading" not in err
    expected = message.format(max_len=config["max_position_embeddings"], tmp=tmp_path, block=block)
    assert err.splitlines()[-1] == f"kvpilot generate: error: {expected}"


def test_generate_cli_refuses_a_bad_sampling_value_before_loading(tmp_path, capsys):
    """The sampling flags are checked before the model is looked for: a missing model would
    be the error otherwise."""
    missing = tmp_path / "no-such-model"
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--model", str(missing), "--prompt", "x", "--temperature", "-1"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == "kvpilot generate: error: --temperature must be >= 0, got -1.0"


def test_vllm_flags_that_change_nothing_are_taken_and_checked(capsys):
    """A vLLM command line's compilation, scheduling-overlap and data-parallel flags parse
    (into nothing kvpilot uses); their values are still checked."""
    argv = [
        "-O3", "-cc", '{"mode": 3}', "--async-scheduling", "-dp", "1", "--model-impl", "vllm",
        "--code-revision", "main", "--max-parallel-loading-workers", "2",
    ]  # fmt: skip
    assert parse(argv) == EngineArgs()
    for bad, message in [
        (["-dp", "2"], "kvpilot runs one engine per pod"),
        (["-O", "4"], "invalid choice: 4"),
        (["--compilation-config", "[1]"], "expected a JSON object"),
        (["--model-impl", "transformers"], "invalid choice: 'transformers'"),
    ]:
        with pytest.raises(SystemExit):
            parse(bad)
        assert message in capsys.readouterr().err
