"""``kvpilot serve`` as a command: flags, failures at startup, no heavy imports for --help."""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys

import pytest

from kvpilot.argv import dash_flag_names, expand_config_file
from kvpilot.engine.server import cli


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(argv)


def refused(capsys, *argv: str) -> str:
    """``kvpilot serve ARGV`` refused before loading: status 2, one line on stderr (returned)."""
    assert cli.run(parse(*argv)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kvpilot serve: error: ")
    return err.removeprefix("kvpilot serve: error: ").rstrip("\n")


def test_engine_flags_use_vllm_spellings_and_model_is_positional():
    args = parse(
        "some/model", "--port", "9000", "--max-model-len", "1024", "--max-num-seqs", "4",
        "--block-size", "32", "--gpu-memory-utilization", "0.8", "--dtype", "float16",
        "--served-model-name", "alias", "--max-waiting-requests", "7", "--api-key", "k",
        "--no-enable-prefix-caching",
    )  # fmt: skip
    assert args.model_tag == "some/model"
    assert (args.port, args.max_model_len, args.max_num_seqs, args.block_size) == (
        9000,
        1024,
        4,
        32,
    )
    assert (args.gpu_memory_utilization, args.dtype) == (0.8, "float16")
    assert (args.served_model_name, args.max_waiting_requests, args.api_key) == ("alias", 7, ["k"])
    assert args.enable_prefix_caching is False


def test_flags_copied_from_vllm_manifests_are_taken(tmp_path):
    args = parse(
        "org/model", "--trust-remote-code", "--enforce-eager", "--disable-log-stats",
        "--disable-log-requests", "--download-dir", str(tmp_path), "--max-model-len", "32k",
        "--max-num-batched-tokens", "4K", "-q", "awq_marlin", "--served-model-name", "a", "b",
        "--api-key", "k1", "k2", "--root-path", "/llm", "--allowed-origins", '["https://x.example"]',
        "--no-enable-lora", "--no-enable-auto-tool-choice", "--disable-uvicorn-access-log",
    )  # fmt: skip
    engine_args, config = cli._configure(args)
    assert (engine_args.max_model_len, engine_args.max_num_batched_tokens) == (32_000, 4096)
    assert (engine_args.quantization, engine_args.download_dir) == ("awq", str(tmp_path))
    assert engine_args.trust_remote_code and engine_args.enforce_eager
    assert (engine_args.served_model_name, config.served_model_names) == ("a", ["a", "b"])
    assert config.api_keys == ["k1", "k2"] and not config.log_requests
    assert config.cors["allow_origins"] == ["https://x.example"]
    assert (args.root_path, args.disable_uvicorn_access_log) == ("/llm", True)
    assert parse("--max-model-len", "auto").max_model_len is None
    assert parse("--max-model-len", "-1").max_model_len is None
    assert parse("--enable-log-requests").enable_log_requests is True
    assert cli._configure(parse())[1].cors["allow_origins"] == ["*"]  # vLLM's default
    config = cli._configure(parse("--max-logprobs", "50", "--response-role", "bot"))[1]
    assert (config.max_logprobs, config.response_role) == (50, "bot")
    assert cli._configure(parse("--max-logprobs", "-1"))[1].max_logprobs is None
    assert cli._configure(parse())[1].max_logprobs == 20


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--max-model-len", "2.5.1k"], "not a number of tokens"),
        (["--max-model-len", "2.5"], "not a whole number of tokens"),
        (["--allowed-origins", "*"], "JSON list of strings"),
        (["-q", "bitsandbytes"], "invalid choice"),
    ],
)
def test_bad_vllm_style_values_are_argparse_errors(capsys, argv, message):
    with pytest.raises(SystemExit):
        parse(*argv)
    assert message in capsys.readouterr().err


def test_config_file_and_underscore_flags_as_vllms_parser_reads_them(tmp_path):
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    config = tmp_path / "serve.yaml"
    config.write_text(
        "model: org/model\nmax_model_len: 1024\nenable-prefix-caching: false\n"
        "served-model-name: [a, b]\ntrust-remote-code: true\nenforce-eager: false\n"
        "hf-overrides: {rope_parameters: {rope_type: default, rope_theta: 5.0e+5}}\n"
        "default-chat-template-kwargs: {enable_thinking: false}\n"
    )
    argv = dash_flag_names(["--config", str(config), "--max_model_len=2048", "--", "--x_y"])
    argv = expand_config_file(argv, parser)
    assert argv[-3:] == ["--max-model-len=2048", "--", "--x_y"]
    args = parser.parse_args(argv[:-2])
    assert (args.model, args.max_model_len, args.enable_prefix_caching) == (
        "org/model",
        2048,
        False,
    )
    assert (args.served_model_names, args.trust_remote_code, args.enforce_eager) == (
        ["a", "b"],
        True,
        False,
    )
    # A mapping is passed on as JSON, as the flag takes it on a command line.
    engine_args, server_config = cli._configure(args)
    assert engine_args.hf_overrides == {
        "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}
    }
    assert server_config.default_chat_template_kwargs == {"enable_thinking": False}
    config.write_text("max_modl_len: 1\n")
    with pytest.raises(ValueError, match="unknown flag 'max_modl_len'"):
        expand_config_file([f"--config={config}"], parser)
    config.write_text("- a list\n")
    with pytest.raises(ValueError, match="a mapping"):
        expand_config_file(["--config", str(config)], parser)
    with pytest.raises(ValueError, match="--config"):
        expand_config_file(["--config", str(tmp_path / "missing.yaml")], parser)


def test_tool_calling_flags_use_vllm_spellings_and_are_checked(capsys):
    args = parse("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    assert (args.enable_auto_tool_choice, args.tool_call_parser) == (True, "hermes")
    assert (parse().enable_auto_tool_choice, parse().tool_call_parser) == (False, None)
    assert "--enable-auto-tool-choice requires --tool-call-parser" in refused(
        capsys, "--enable-auto-tool-choice"
    )
    message = refused(capsys, "--enable-auto-tool-choice", "--tool-call-parser", "llama9")
    assert re.search("unknown parser 'llama9'.*hermes", message), message


def test_chat_template_flags_use_vllm_spellings(tmp_path):
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    args = parse("--chat-template", str(template), "--trust-request-chat-template")
    assert (args.chat_template, args.trust_request_chat_template) == (str(template), True)
    assert (parse().chat_template, parse().trust_request_chat_template) == (None, False)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (
            "/no/such/template.jinja",
            "--chat-template: '/no/such/template.jinja' looks like a file path, but it cannot "
            "be read: [Errno 2] No such file or directory",
        ),
        (
            "{% for m in messages %}{{ m.content }}",
            "--chat-template: the template does not compile: Unexpected end of template",
        ),
    ],
)
def test_bad_chat_template_stops_serve_with_one_line(capsys, value, message):
    assert refused(capsys, "--chat-template", value).startswith(message)


def test_bad_chat_template_file_stops_the_command_before_loading(tmp_path):
    template = tmp_path / "broken.jinja"
    template.write_text("{{ messages | no_such_filter }}")
    result = subprocess.run(
        [sys.executable, "-m", "kvpilot", "serve", "--chat-template", str(template)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr == (
        "kvpilot serve: error: --chat-template: the template does not compile: "
        "No filter named 'no_such_filter'. (line 1)\n"
    )


def test_module_imports_no_torch():
    code = "import sys, kvpilot.engine.server.cli; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout.strip() == "False"


def test_conflicting_model_arguments_are_refused(capsys):
    assert refused(capsys, "a", "--model", "b") == "got model 'a' and --model 'b'; give one"


def failed_load(model: str) -> str:
    """``kvpilot serve model``'s last line on stderr, once it exited with status 1 (the model
    failed to load) and printed no traceback."""
    result = subprocess.run(
        [sys.executable, "-m", "kvpilot", "serve", model, "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    return result.stderr.splitlines()[-1]


def test_missing_model_exits_with_status_1_naming_it():
    assert failed_load("/no/such/model") == (
        "kvpilot serve: loading the model failed: model '/no/such/model' is neither a model "
        "folder nor a .gguf file, and not a Hub id"
    )


def test_an_unknown_checkpoint_dtype_stops_serve_naming_it(tiny_model_dir, tmp_path):
    # The planner refuses it as InvalidModelConfig; serve ran "int3" as float32 (transformers
    # found torch.int3) and died of an AttributeError traceback for a name torch lacks.
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama"), folder)
    config = json.loads((folder / "config.json").read_text())
    for value in ("int3", "int33"):
        (folder / "config.json").write_text(json.dumps({**config, "dtype": value}))
        assert failed_load(str(folder)) == (
            f"kvpilot serve: loading the model failed: {folder}/config.json: 'dtype' (the "
            "checkpoint's dtype) must be one of float32, float, float16, half, bfloat16, "
            f"float8_e4m3fn, float8_e5m2, got {value!r}"
        )


def test_a_missing_tokenizer_folder_is_named_as_the_tokenizer():
    from kvpilot.engine.model_loader.tokenizer import load_tokenizer

    with pytest.raises(FileNotFoundError) as missing:
        load_tokenizer("/no/such/tokenizer")
    assert str(missing.value) == "tokenizer folder /no/such/tokenizer does not exist"


def test_a_bad_engine_flag_stops_serve_naming_the_flag(capsys):
    assert (
        refused(capsys, "-pp", "0") == "--pipeline-parallel-size must be a positive integer, got 0"
    )
    assert refused(capsys, "--block-size", "0") == "--block-size must be a positive integer, got 0"
    assert (
        refused(capsys, "--max-waiting-requests", "0")
        == "--max-waiting-requests must be at least 1"
    )
    assert refused(capsys, "--max-logprobs", "-2") == (
        "--max-logprobs must be -1 (the vocabulary) or 0 or more"
    )
