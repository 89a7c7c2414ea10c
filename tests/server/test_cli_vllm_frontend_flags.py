"""vLLM 0.32's frontend flags on ``kvpilot serve``'s command line: parsing, their values in the
server's configuration, and the refusals that stop the command before the model loads.

The flags at work on a live server: ``test_vllm_frontend_flags.py``.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest

from kvpilot.engine.server import cli
from kvpilot.operator.crd import MANAGED_FLAGS
from tests.server.test_cli import parse, refused

FLAGS = (
    "--disable-fastapi-docs",
    "--max-log-len",
    "--enable-log-outputs",
    "--default-chat-template-kwargs",
    "--exclude-tools-when-tool-choice-none",
    "--enable-prompt-tokens-details",
    "--enable-force-include-usage",
    "--chat-template-content-format",
    "--api-server-count",
    "--log-config-file",
    "--enable-server-load-tracking",
)


def argparse_error(capsys, *argv: str) -> str:
    """The message argparse stops on for ``argv``."""
    with pytest.raises(SystemExit) as stopped:
        parse(*argv)
    assert stopped.value.code == 2
    return capsys.readouterr().err


def test_the_flags_parse_with_vllms_spellings_and_reach_the_server_config():
    args = parse(
        "--disable-fastapi-docs", "--enable-log-requests", "--max-log-len", "40",
        "--enable-log-outputs", "--no-enable-log-deltas",
        "--default-chat-template-kwargs", '{"enable_thinking": false, "n": 2}',
        "--exclude-tools-when-tool-choice-none", "--enable-prompt-tokens-details",
        "--enable-force-include-usage", "--chat-template-content-format", "openai",
        "-asc", "1",
    )  # fmt: skip
    _, config = cli._configure(args)
    assert config.disable_fastapi_docs and config.log_requests and config.log_outputs
    assert (config.max_log_len, config.log_deltas) == (40, False)
    assert config.default_chat_template_kwargs == {"enable_thinking": False, "n": 2}
    assert config.exclude_tools_when_tool_choice_none
    assert config.enable_prompt_tokens_details and config.enable_force_include_usage
    assert config.chat_template_content_format == "openai"
    assert args.api_server_count == 1
    assert parse("--api-server-count", "1").api_server_count == 1


def test_defaults_are_vllms():
    args = parse()
    _, config = cli._configure(args)
    assert not config.disable_fastapi_docs and config.max_log_len is None
    assert not config.log_outputs and config.log_deltas
    assert config.default_chat_template_kwargs == {}
    assert not config.exclude_tools_when_tool_choice_none
    assert not config.enable_prompt_tokens_details and not config.enable_force_include_usage
    assert config.chat_template_content_format == "auto"
    assert (args.api_server_count, args.log_config_file) == (None, None)


def test_boolean_flags_take_their_no_forms_as_vllms_do():
    args = parse(
        "--no-disable-fastapi-docs", "--no-enable-prompt-tokens-details",
        "--no-enable-force-include-usage", "--no-exclude-tools-when-tool-choice-none",
        "--no-enable-log-outputs",
    )  # fmt: skip
    assert not any(
        (
            args.disable_fastapi_docs,
            args.enable_prompt_tokens_details,
            args.enable_force_include_usage,
            args.exclude_tools_when_tool_choice_none,
            args.enable_log_outputs,
        )
    )


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("{enable_thinking: false}", "not JSON"),
        ('["enable_thinking"]', "expected a JSON object"),
        ("false", "expected a JSON object"),
    ],
)
def test_bad_default_chat_template_kwargs_are_argparse_errors_naming_the_flag(
    capsys, value, message
):
    err = argparse_error(capsys, "--default-chat-template-kwargs", value)
    assert "argument --default-chat-template-kwargs:" in err and message in err


def test_default_chat_template_kwargs_that_no_template_could_take_are_refused(capsys, caplog):
    message = refused(capsys, "--default-chat-template-kwargs", '{"tokenize": true, "tools": []}')
    assert message.startswith("--default-chat-template-kwargs: 'tokenize', 'tools' cannot be set")
    # A request's own add_generation_prompt always wins in vLLM: such a default is dropped.
    with caplog.at_level(logging.WARNING, logger="kvpilot.server"):
        config = cli._configure(
            parse("--default-chat-template-kwargs", '{"add_generation_prompt": false, "x": 1}')
        )[1]
    assert config.default_chat_template_kwargs == {"x": 1}
    assert "'add_generation_prompt' is ignored" in caplog.text


def test_log_outputs_needs_log_requests_as_in_vllm(capsys):
    assert refused(capsys, "--enable-log-outputs") == (
        "--enable-log-outputs requires --enable-log-requests"
    )
    assert refused(capsys, "--max-log-len", "-1") == "--max-log-len must be 0 or more"


def test_content_format_is_one_of_vllms(capsys):
    assert "invalid choice: 'text'" in argparse_error(
        capsys, "--chat-template-content-format", "text"
    )


@pytest.mark.parametrize("value", ["2", "0", "-1", "auto"])
def test_an_api_server_count_other_than_1_is_refused_saying_how_to_scale(capsys, value):
    err = argparse_error(capsys, "--api-server-count", value)
    assert f"argument --api-server-count/-asc: {value!r}: kvpilot runs one API server per " in err
    assert "replicas" in err


def test_log_config_file_is_read_and_checked_before_the_model_loads(capsys, tmp_path):
    missing = tmp_path / "missing.json"
    assert refused(capsys, "--log-config-file", str(missing)) == (
        f"--log-config-file: cannot read {str(missing)!r}: No such file or directory"
    )
    bad = tmp_path / "bad.json"
    bad.write_text("version: 1\n")
    assert refused(capsys, "--log-config-file", str(bad)).startswith(
        f"--log-config-file: {str(bad)!r} is not JSON: Expecting value: line 1 column 1"
    )
    listed = tmp_path / "list.json"
    listed.write_text("[1]")
    assert refused(capsys, "--log-config-file", str(listed)) == (
        f"--log-config-file: {str(listed)!r} must hold a JSON object (a logging.config."
        "dictConfig configuration), got list"
    )
    assert cli.load_log_config(None) is None
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"version": 1, "disable_existing_loggers": False}))
    assert cli.load_log_config(str(good)) == {"version": 1, "disable_existing_loggers": False}


def test_a_log_config_that_dictconfig_refuses_stops_serve_before_anything_loads(tmp_path):
    # In a process of its own: applying a logging configuration, even a refused one, would
    # close this test process's log handlers.
    refusal = tmp_path / "refused.json"
    refusal.write_text(json.dumps({"version": 1, "handlers": {"h": {"class": "no.such.Handler"}}}))
    result = subprocess.run(
        [sys.executable, "-m", "kvpilot", "serve", "/no/such/model", "--log-config-file",
         str(refusal)],
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.startswith(
        "kvpilot serve: error: --log-config-file: the configuration was refused: Unable to "
        "configure handler 'h'"
    )
    assert result.stderr.count("\n") == 1


def test_server_load_tracking_is_off_by_default_and_takes_its_no_form():
    assert cli._configure(parse("--enable-server-load-tracking"))[1].enable_server_load_tracking
    assert not cli._configure(parse())[1].enable_server_load_tracking
    args = parse("--enable-server-load-tracking", "--no-enable-server-load-tracking")
    assert not cli._configure(args)[1].enable_server_load_tracking


def test_lora_cache_and_dtype_flags_reach_the_engine_args():
    engine_args, _ = cli._configure(
        parse("--enable-lora", "--max-loras", "2", "--max-cpu-loras", "5", "--lora-dtype",
              "bfloat16")
    )  # fmt: skip
    assert (engine_args.max_cpu_loras, engine_args.lora_dtype) == (5, "bfloat16")
    defaults, _ = cli._configure(parse("--enable-lora", "--max-cpu-loras", "0"))
    assert (defaults.max_cpu_loras, defaults.lora_dtype) == (None, "auto")  # vLLM: max_loras


def test_lora_cache_below_max_loras_and_unknown_lora_dtypes_are_refused(capsys):
    # vLLM's rule and wording, the fields spelled as flags.
    assert refused(capsys, "--enable-lora", "--max-loras", "3", "--max-cpu-loras", "2") == (
        "--max-cpu-loras (2) must be >= --max-loras (3)"
    )
    err = argparse_error(capsys, "--lora-dtype", "int8")
    assert (
        "argument --lora-dtype: invalid choice: 'int8' (choose from 'auto', 'float16', "
        "'bfloat16', 'float32')" in err
    )
    assert "argument --max-cpu-loras: invalid int value: 'x'" in argparse_error(
        capsys, "--max-cpu-loras", "x"
    )


def test_the_operator_manages_none_of_these_flags():
    assert not set(FLAGS) & set(MANAGED_FLAGS)
    assert "-asc" not in MANAGED_FLAGS
