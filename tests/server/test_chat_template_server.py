"""Chat templates over HTTP: the server's ``--chat-template`` (here on a model without a template
of its own) and a request's ``chat_template`` under ``--trust-request-chat-template``, checked
token by token through vLLM's ``prompt_logprobs`` (each prompt token's id comes back), with the
official ``openai`` client; broken request templates are 400s naming ``chat_template``;
``chat_template_kwargs`` win over the top-level settings of the same template variables, and
are 400s naming them when they are not template variables."""

from __future__ import annotations

import openai
import pytest

from kvpilot.engine.model_loader import DEFAULT_MODEL_NAME as MODEL

SERVER_TEMPLATE = (
    "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)
REQUEST_TEMPLATE = (
    "{{ greeting }}{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
ASK = [{"role": "user", "content": "Name a color."}]


@pytest.fixture(scope="module")
def model_without_template(tmp_path_factory, default_model_dir):
    """The default model's files, less its chat template (links to the originals)."""
    folder = tmp_path_factory.mktemp("no-chat-template")
    for path in default_model_dir.iterdir():
        if path.name != "chat_template.jinja":
            (folder / path.name).symlink_to(path)
    assert "chat_template" not in (folder / "tokenizer_config.json").read_text()
    return folder


@pytest.fixture(scope="module")
def server(start_server, model_without_template, tmp_path_factory):
    template_file = tmp_path_factory.mktemp("templates") / "server.jinja"
    template_file.write_text(SERVER_TEMPLATE)
    return start_server(
        str(model_without_template), "--served-model-name", MODEL, "--max-model-len", "256",
        "--chat-template", str(template_file), "--trust-request-chat-template",
    )  # fmt: skip


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.openai_client()


def prompt_token_ids(client: openai.OpenAI, messages, **extra_body) -> list[int | None]:
    """The ids of the prompt the server rendered: ``prompt_logprobs`` 0 returns each prompt
    token's own entry (None for the first, which has no logprob)."""
    response = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=1,
        extra_body={"prompt_logprobs": 0, **extra_body},
    )
    entries = response.model_extra["prompt_logprobs"]
    assert response.usage.prompt_tokens == len(entries)
    return [None if entry is None else int(next(iter(entry))) for entry in entries]


def expected_ids(tokenizer, text: str) -> list[int | None]:
    ids = tokenizer.encode(text, add_special_tokens=False)
    return [None, *ids[1:]]


def test_server_template_renders_requests_for_a_model_without_one(client, default_tokenizer):
    assert prompt_token_ids(client, ASK) == expected_ids(
        default_tokenizer, "[user] Name a color.\n[assistant]"
    )


@pytest.mark.parametrize(
    "body",
    [
        {"chat_template": REQUEST_TEMPLATE, "chat_template_kwargs": {"greeting": "Hi! "}},
        # vLLM reads the template from chat_template_kwargs too.
        {"chat_template_kwargs": {"chat_template": REQUEST_TEMPLATE, "greeting": "Hi! "}},
    ],
)
def test_trusted_request_template_replaces_the_servers(client, default_tokenizer, body):
    assert prompt_token_ids(client, ASK, **body) == expected_ids(
        default_tokenizer, "Hi! <user>Name a color.<assistant>"
    )


def test_request_template_continues_the_final_message(client, default_tokenizer):
    messages = [*ASK, {"role": "assistant", "content": "Blue and"}]
    ids = prompt_token_ids(
        client,
        messages,
        chat_template=REQUEST_TEMPLATE,
        chat_template_kwargs={"greeting": ""},
        add_generation_prompt=False,
        continue_final_message=True,
    )
    assert ids == expected_ids(default_tokenizer, "<user>Name a color.<assistant>Blue and")


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("{% for %}", "chat_template: the template does not compile: Expected an expression"),
        ("{{ messages | no_such_filter }}", "the template does not compile: No filter named"),
        ("{{ raise_exception('no user turns') }}", "template refused them: no user turns"),
        ("{% for m in messages %}{{ m.content + 1 }}{% endfor %}", "refused them"),
        ("{{ '' }}", "chat_template: the rendered prompt is empty"),
    ],
)
def test_broken_request_template_is_a_400_naming_it(client, template, message):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=1, extra_body={"chat_template": template}
        )
    assert error.value.status_code == 400
    assert error.value.body["param"] == "chat_template"
    assert message in error.value.body["message"]
    # The server goes on answering with its own template.
    reply = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2)
    assert reply.usage.completion_tokens >= 1


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_kwargs_win_over_the_top_level_settings(
    client, default_tokenizer, add_generation_prompt
):
    # vLLM's merge: the kwargs over the request's own add_generation_prompt.
    ids = prompt_token_ids(
        client,
        ASK,
        add_generation_prompt=add_generation_prompt,
        chat_template_kwargs={"add_generation_prompt": False},
    )
    assert ids == expected_ids(default_tokenizer, "[user] Name a color.\n")
    # The default prompt is the same plus the generation prompt's tokens.
    with_prompt = prompt_token_ids(client, ASK)
    assert with_prompt == expected_ids(default_tokenizer, "[user] Name a color.\n[assistant]")
    assert with_prompt[: len(ids)] == ids and len(with_prompt) > len(ids)
    messages = [*ASK, {"role": "assistant", "content": "Blue and"}]
    continued = prompt_token_ids(
        client,
        messages,
        chat_template_kwargs={"add_generation_prompt": False, "continue_final_message": True},
    )
    assert continued == expected_ids(
        default_tokenizer, "[user] Name a color.\n[assistant] Blue and"
    )


@pytest.mark.parametrize(
    "kwargs",
    [
        {"tokenize": True},
        {"messages": [{"role": "user", "content": "Something else."}]},
        {"conversation": []},
        {"return_dict": True},
        {"tokenizer": "gpt2", "add_generation_prompt": False},
    ],
)
def test_chat_template_kwargs_that_are_not_template_variables_are_a_400_naming_them(client, kwargs):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=1, extra_body={"chat_template_kwargs": kwargs}
        )
    assert error.value.status_code == 400
    assert error.value.body["param"] == "chat_template_kwargs"
    [name] = (name for name in kwargs if name != "add_generation_prompt")
    assert f"chat_template_kwargs: {name!r} cannot be set here" in error.value.body["message"]
    assert "multiple values" not in error.value.body["message"]
