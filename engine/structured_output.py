"""Structured outputs: sampling constrained to a JSON Schema, JSON, a regex, choices or a grammar.

vLLM V1's design on the xgrammar backend (Dong et al. 2024, "XGrammar: Flexible and Efficient
Structured Generation Engine for Large Language Models"): a request's constraint is compiled
once against the tokenizer's vocabulary into a grammar with precomputed token masks (xgrammar
caches compiled grammars by their source, so a schema sent again is not compiled again); each
sequence gets a ``GrammarMatcher`` (a pushdown automaton over the grammar); before every step
that samples a constrained sequence the engine asks its matcher for a bitmask of the tokens
allowed next, the model runner sets every other token's logit to -inf before sampling, and the
matcher then accepts the sampled token. When the grammar is complete only EOS is allowed; once
the matcher has accepted it (or, with ``ignore_eos``, any token that ends the grammar) the
sequence is finished.

The manager lives in the engine's process next to the scheduler (the bitmask travels to
tensor-parallel workers inside the ``SchedulerOutput``). xgrammar is imported on first use: an
engine that never sees a constrained request never loads it, and unconstrained requests cost
one empty-dict check per step.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from kvpilot.engine.sampling_params import StructuredOutputsParams
from kvpilot.engine.scheduler_output import SchedulerOutput

if TYPE_CHECKING:  # the API process imports this module (its checks) without torch
    import torch
    import xgrammar

logger = logging.getLogger("kvpilot.engine")

# Most bytes of compiled grammars xgrammar keeps cached (vLLM's default, 512 MiB).
GRAMMAR_CACHE_LIMIT_BYTES = 512 * 2**20
# Threads xgrammar may use to compile one grammar.
COMPILE_THREADS = 2
# xgrammar prefixes its errors with "[hh:mm:ss] /path/to/file.cc:123: ".
_XGRAMMAR_ERROR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")


class StructuredOutputManager:
    """Compiles constraints and keeps one grammar matcher per constrained sequence.

    Args:
        load_tokenizer: returns a tokenizer for this manager alone (called once, on first
            compile): building xgrammar's vocabulary table reads the whole tokenizer, and the
            engine's own tokenizer is busy on the engine thread.
        vocab_size: the model's vocabulary size (its logits' width, possibly padded beyond the
            tokenizer's).
        eos_token_ids: the tokens that end a sequence once its grammar is complete.

    ``compile`` is thread-safe (a server compiles on a worker thread before it adds the
    request); everything else runs on the engine's thread.
    """

    def __init__(
        self, load_tokenizer: Callable[[], Any], vocab_size: int, eos_token_ids: Iterable[int]
    ) -> None:
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._compiler_lock = threading.Lock()
        self._matchers: dict[str, xgrammar.GrammarMatcher] = {}

    @property
    def is_loaded(self) -> bool:
        """Whether xgrammar's compiler exists (False until the first constrained request)."""
        return self._compiler is not None

    def compile(self, params: StructuredOutputsParams) -> xgrammar.CompiledGrammar:
        """Compile a constraint (or fetch it from xgrammar's cache).

        Args:
            params: the constraint; ``choice`` becomes the grammar ``root ::= "a" | "b" ...``,
                ``json_object`` the JSON Schema ``{"type": "object"}``.

        Returns:
            The compiled grammar, from which ``add_request`` builds matchers.

        Raises:
            ValueError: ``structured_outputs: ...`` naming what is invalid (a JSON Schema that
                does not parse, or uses a keyword xgrammar would not enforce (see
                ``check_xgrammar_support``), a bad regex or grammar).
        """
        kind = params.kind
        if kind == "json":
            schema = _parse_json_schema(params.json)
            try:
                check_xgrammar_support(schema)
            except ValueError as exc:
                raise ValueError(f"structured_outputs: {exc}") from None
        compiler = self._get_compiler()
        any_whitespace = not params.disable_any_whitespace
        try:
            if kind == "json":
                return compiler.compile_json_schema(
                    json.dumps(schema), any_whitespace=any_whitespace
                )
            if kind == "json_object":
                return compiler.compile_json_schema(
                    '{"type": "object"}', any_whitespace=any_whitespace
                )
            if kind == "regex":
                return compiler.compile_regex(params.regex)
            if kind == "choice":
                alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in params.choice)
                return compiler.compile_grammar(f"root ::= {alternatives}")
            return compiler.compile_grammar(params.grammar)
        except (RuntimeError, ValueError) as exc:
            raise ValueError(f"structured_outputs: invalid {kind}: {_reason(exc)}") from None

    def _get_compiler(self) -> xgrammar.GrammarCompiler:
        with self._compiler_lock:
            if self._compiler is None:
                import xgrammar

                info = xgrammar.TokenizerInfo.from_huggingface(
                    self._load_tokenizer(),
                    vocab_size=self.vocab_size,
                    stop_token_ids=self.eos_token_ids or None,
                )
                self._compiler = xgrammar.GrammarCompiler(
                    info,
                    max_threads=COMPILE_THREADS,
                    cache_limit_bytes=GRAMMAR_CACHE_LIMIT_BYTES,
                )
            return self._compiler

    def add_request(self, request_id: str, grammar: xgrammar.CompiledGrammar) -> None:
        """Start a matcher at the beginning of ``grammar`` for one sequence."""
        import xgrammar

        self._matchers[request_id] = xgrammar.GrammarMatcher(grammar)

    def remove_requests(self, request_ids: Iterable[str]) -> None:
        """Forget the matchers of finished or aborted sequences (unknown ids are ignored)."""
        for request_id in request_ids:
            self._matchers.pop(request_id, None)

    def has_request(self, request_id: str) -> bool:
        """Whether the sequence is constrained."""
        return request_id in self._matchers

    @property
    def num_requests(self) -> int:
        """Constrained sequences in flight."""
        return len(self._matchers)

    def set_grammar_bitmask(self, scheduler_output: SchedulerOutput) -> None:
        """Set ``scheduler_output.grammar_bitmask`` for the constrained sequences that sample
        this step (left None when there are none).

        The bitmask is ``[num_constrained, ceil(vocab_size / 32)]`` int32 on the CPU: bit
        ``j % 32`` of word ``j // 32`` is set when token ``j`` may come next; its rows follow
        ``scheduler_output.structured_output_request_ids``.
        """
        if not self._matchers:
            return
        request_ids = [
            s.request.request_id
            for s in scheduler_output.scheduled
            if s.sample and s.request.request_id in self._matchers
        ]
        if not request_ids:
            return
        import xgrammar

        bitmask = xgrammar.allocate_token_bitmask(len(request_ids), self.vocab_size)
        for row, request_id in enumerate(request_ids):
            self._matchers[request_id].fill_next_token_bitmask(bitmask, row)
        scheduler_output.structured_output_request_ids = request_ids
        scheduler_output.grammar_bitmask = bitmask

    def accept_tokens(self, request_id: str, token_ids: list[int]) -> bool:
        """Advance a sequence's matcher over its newly sampled tokens.

        Returns:
            False when the sequence cannot go on: its grammar is complete and has taken its
            end token, or the matcher refused a token (possible only when every allowed token
            was masked by another rule, e.g. EOS before ``min_tokens``). True otherwise, and
            for sequences without a constraint.
        """
        matcher = self._matchers.get(request_id)
        if matcher is None:
            return True
        for token_id in token_ids:
            if not matcher.accept_token(token_id):
                logger.warning(
                    "request %s: token %d is outside its grammar; ending it", request_id, token_id
                )
                return False
        return not matcher.is_terminated()


def check_json_schema(schema: dict[str, Any]) -> None:
    """Check that ``schema`` is a JSON Schema structured outputs can enforce, without compiling
    it against a vocabulary (xgrammar converts it to a grammar in about a millisecond and needs
    no tokenizer). Keywords xgrammar does not know are ignored, as JSON Schema allows, and so
    are those it would not enforce: ``check_xgrammar_support`` refuses them when the schema
    constrains an output (tools' parameters under ``tool_choice: "auto"`` only reach the
    prompt).

    Raises:
        ValueError: what is wrong (e.g. ``Unsupported type "objekt"``), as xgrammar reports it.
    """
    import xgrammar

    try:
        xgrammar.Grammar.from_json_schema(json.dumps(schema))
    except (RuntimeError, ValueError, TypeError) as exc:
        raise ValueError(_reason(exc)) from None


def _parse_json_schema(schema: str | dict[str, Any]) -> dict[str, Any]:
    """``StructuredOutputsParams.json`` as a dict.

    Raises:
        ValueError: ``structured_outputs: invalid json: ...`` when it does not parse or is not
            a JSON object.
    """
    try:
        parsed = json.loads(schema) if isinstance(schema, str) else schema
    except ValueError as exc:
        raise ValueError(f"structured_outputs: invalid json: {exc}") from None
    if not isinstance(parsed, dict):
        raise ValueError("structured_outputs: invalid json: a JSON Schema must be a JSON object")
    return parsed


# Keywords xgrammar 0.2.9 ignores wherever they appear (it logs a warning and accepts output
# that breaks them), checked against it one by one.
_IGNORED_KEYWORDS = (
    "not",
    "if",
    "then",
    "else",
    "contains",
    "minContains",
    "maxContains",
    "dependentSchemas",
    "dependentRequired",
    "dependencies",
)
# Keywords that constrain an instance (JSON Schema 2020-12 and draft 7's ``dependencies``);
# the others (title, description, default, $defs, vendor extensions, ...) only annotate.
_CONSTRAINTS = frozenset(
    {
        "type", "enum", "const", "multipleOf", "maximum", "exclusiveMaximum", "minimum",
        "exclusiveMinimum", "maxLength", "minLength", "pattern", "format", "maxItems",
        "minItems", "uniqueItems", "maxContains", "minContains", "maxProperties",
        "minProperties", "required", "dependentRequired", "dependencies", "properties",
        "patternProperties", "additionalProperties", "propertyNames", "items", "prefixItems",
        "additionalItems", "contains", "unevaluatedItems", "unevaluatedProperties", "allOf",
        "anyOf", "oneOf", "not", "if", "then", "else", "dependentSchemas", "$ref",
    }
)  # fmt: skip
# xgrammar compiles these alone and drops every other constraint beside them.
_EXCLUSIVE_KEYWORDS = ("$ref", "allOf", "anyOf", "oneOf")
# Where subschemas sit: one schema, a list of schemas, or a map of names to schemas.
_SUBSCHEMA_KEYWORDS = (
    "items",
    "additionalItems",
    "additionalProperties",
    "unevaluatedItems",
    "unevaluatedProperties",
    "propertyNames",
)
_SUBSCHEMA_LIST_KEYWORDS = ("items", "prefixItems", "allOf", "anyOf", "oneOf")
_SUBSCHEMA_MAP_KEYWORDS = ("properties", "patternProperties", "$defs", "definitions")
_JSON_TYPES: dict[str, Callable[[Any], bool]] = {
    "null": lambda v: v is None,
    "boolean": lambda v: isinstance(v, bool),
    "integer": lambda v: type(v) is int or (type(v) is float and v.is_integer()),
    "number": lambda v: type(v) in (int, float),
    "string": lambda v: isinstance(v, str),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
}
_PLAIN_KEY = re.compile(r"^[A-Za-z_$][\w$-]*$")


def check_xgrammar_support(schema: dict[str, Any]) -> None:
    """Refuse a JSON Schema that uses a feature xgrammar 0.2.9 does not enforce, as vLLM's
    xgrammar backend does (``has_xgrammar_unsupported_json_features``): xgrammar only logs a
    warning and compiles a grammar whose output may break the schema.

    Checked against xgrammar 0.2.9, which accepts output that breaks: ``not``,
    ``if``/``then``/``else``, ``contains``/``minContains``/``maxContains``,
    ``dependentSchemas``, ``dependentRequired``, ``dependencies``, ``uniqueItems: true``,
    ``multipleOf`` except an integral one on ``type: "integer"``, ``patternProperties`` and
    ``propertyNames`` without ``type: "object"``, ``allOf`` with more than one subschema, any
    constraint beside ``$ref``/``allOf``/``anyOf``/``oneOf`` (it compiles them alone; a
    ``type`` every alternative has anyway is let through), beside
    ``enum``/``const`` (other than ``type``) or ``minLength``/``maxLength`` beside
    ``pattern``/``format``, and ``enum``/``const`` values of a type ``type`` excludes. It does
    enforce ``unevaluatedProperties``/``unevaluatedItems`` and typed ``patternProperties``/
    ``propertyNames``. Every subschema is checked, ``$defs`` included.

    Raises:
        ValueError: e.g. ``the JSON schema uses 'multipleOf' at $.properties.n, which is not
            supported``.
    """
    _check_subschema(schema, "$")


def _check_subschema(schema: Any, path: str) -> None:
    if not isinstance(schema, dict):
        return  # true, false, or not a schema (xgrammar reports the latter)
    feature = _unsupported_feature(schema)
    if feature is not None:
        raise ValueError(f"the JSON schema uses {feature} at {path}, which is not supported")
    types = _schema_types(schema)
    for keyword in ("enum", "const"):
        values = schema.get(keyword, []) if keyword == "enum" else [schema.get(keyword)]
        if keyword in schema and types and isinstance(values, list):
            for value in values:
                if not any(_JSON_TYPES.get(t, lambda v: True)(value) for t in types):
                    raise ValueError(
                        f"the JSON schema at {path} has {json.dumps(value)} in {keyword!r}, "
                        f"which its type ({', '.join(sorted(types))}) excludes"
                    )
    for keyword, value in schema.items():
        if keyword in _SUBSCHEMA_KEYWORDS and isinstance(value, dict):
            _check_subschema(value, f"{path}.{keyword}")
        elif keyword in _SUBSCHEMA_LIST_KEYWORDS and isinstance(value, list):
            for index, subschema in enumerate(value):
                _check_subschema(subschema, f"{path}.{keyword}[{index}]")
        elif keyword in _SUBSCHEMA_MAP_KEYWORDS and isinstance(value, dict):
            for name, subschema in value.items():
                key = f".{name}" if _PLAIN_KEY.match(str(name)) else f"[{json.dumps(name)}]"
                _check_subschema(subschema, f"{path}.{keyword}{key}")


def _unsupported_feature(schema: dict[str, Any]) -> str | None:
    """The first feature of ``schema`` itself (not its subschemas) xgrammar would not enforce
    (ignored keywords in the schema's order first),
    quoted for a message (``'not'``, ``'allOf' with 2 subschemas``), or None."""
    for keyword in schema:
        if keyword in _IGNORED_KEYWORDS:
            return repr(keyword)
    if schema.get("uniqueItems", False) is not False:
        return "'uniqueItems'"
    types = _schema_types(schema)
    if "multipleOf" in schema:
        divisor = schema["multipleOf"]
        integral = type(divisor) in (int, float) and float(divisor).is_integer()
        if not (integral and "integer" in types and "number" not in types):
            return "'multipleOf'"
    for keyword in ("patternProperties", "propertyNames"):
        if keyword in schema and "object" not in types:
            return repr(keyword)
    all_of = schema.get("allOf")
    if isinstance(all_of, list) and len(all_of) != 1:
        return f"'allOf' with {len(all_of)} subschemas"
    for keyword in _EXCLUSIVE_KEYWORDS:
        if keyword in schema:
            # "type" named last: the other siblings are the likelier mistake.
            beside = sorted(
                (k for k in schema if k in _CONSTRAINTS and k != keyword), key="type".__eq__
            )
            if beside == ["type"] and _implies_type(schema[keyword], types):
                continue  # xgrammar drops it, but every alternative has that type anyway
            if beside:
                return f"{beside[0]!r} beside {keyword!r}"
    for keyword in ("enum", "const"):
        if keyword in schema:
            beside = [k for k in schema if k in _CONSTRAINTS - {"enum", "const", "type"}]
            if beside:
                return f"{beside[0]!r} beside {keyword!r}"
    for keyword in ("pattern", "format"):
        if keyword in schema:
            for bound in ("minLength", "maxLength"):
                if bound in schema:
                    return f"{bound!r} beside {keyword!r}"
    return None


def _implies_type(subschemas: Any, types: set[str]) -> bool:
    """Whether each of ``subschemas`` (a list of schemas) declares only ``types``, or has
    ``properties`` (which xgrammar compiles as an object) when ``types`` allow objects."""
    if not isinstance(subschemas, list) or not types:
        return False
    return all(
        isinstance(sub, dict)
        and (
            _schema_types(sub) <= types
            if _schema_types(sub)
            else "properties" in sub and "object" in types
        )
        for sub in subschemas
    )


def _schema_types(schema: dict[str, Any]) -> set[str]:
    """The JSON types ``schema``'s ``type`` names (a name or a list of names; empty if none)."""
    declared = schema.get("type")
    names = declared if isinstance(declared, list) else [declared]
    return {name for name in names if isinstance(name, str)}


def _reason(exc: Exception) -> str:
    return _XGRAMMAR_ERROR_PREFIX.sub("", str(exc)).strip()


def apply_grammar_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set the logits of the tokens a grammar does not allow next to -inf, in place.

    Args:
        logits: ``[num_rows, vocab_size]`` float logits.
        bitmask: ``[len(rows), ceil(vocab_size / 32)]`` int32 (xgrammar's layout: bit ``j % 32``
            of word ``j // 32`` set when token ``j`` is allowed), on any device.
        rows: the logits row each bitmask row applies to.
    """
    import torch

    vocab_size = logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    words = bitmask.to(device=logits.device, dtype=torch.int32)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :vocab_size]
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
