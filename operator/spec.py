"""An ``LLMDeployment``'s spec as typed values with defaults (pure).

The CRD's openAPIV3Schema and CEL rules reject bad specs at the API server; this module
enforces the same rules again (and the CEL ones, which some API servers and test emulators do
not evaluate), so the operator never acts on a spec the schema would refuse. Every error names
the field path, e.g. ``spec.autoscaling.minReplicas``.

The schema's ranges, enums, patterns, required fields and defaults are not restated here: the
reader takes them from the one declaration of the schema, :data:`kvpilot.operator.crd.SPEC_SCHEMA`,
that the CRD's YAML is generated from. What the schema cannot say is checked here by hand: the
CEL rules, the shape of each model source, Kubernetes quantities, and the extra rules of CPU
mode (a memory limit, which the planner sizes the KV cache from).

Defaults: the CRD's (``replicas`` 1, which the autoscaler moves into ``[minReplicas,
maxReplicas]``; ``gpu.resourceName`` ``nvidia.com/gpu``; ``engine.dtype`` ``auto``;
``autoscaling.mode`` ``kvpilot``; ``autoscaling.minReplicas`` 1;
``autoscaling.predictiveScaling`` true; ``autoscaling.allowKvCacheDtype`` false;
``engine.kvCacheDtype`` ``auto``; ``hfTokenSecretRef.key`` ``token``), applied for
objects that did not pass an API server; then the operator's own: ``gpu.perNode`` from the GPU
catalogue, ``image`` ``ENGINE_IMAGE``, ``modelCache.accessMode`` ``ReadWriteOnce``, resources
per mode (``DEFAULT_CPU_RESOURCES``, ``DEFAULT_GPU_RESOURCES``). Fields left ``None`` are
decided by the planner, the autoscaler or the engine.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvpilot.engine.model_loader import DEFAULT_MODEL_NAME
from kvpilot.operator.crd import (
    ACCESS_MODES,
    DNS_1035,
    FILE_SOURCE,
    HF_SOURCE,
    NAME_MAX_LENGTH,
    PVC_SOURCE,
    SPEC_SCHEMA,
    default,
    field_schema,
    managed_flag,
)
from kvpilot.operator.gpus import CUSTOM, DEFAULT_RESOURCE_NAME, GpuType, gpu_type
from kvpilot.operator.images import ENGINE_IMAGE

RESOURCE_KEYS = tuple(field_schema("resources.requests")["properties"])
"""The resources an engine container may ask for in ``spec.resources`` (GPUs come from the plan)."""

DEFAULT_CPU_RESOURCES = {
    "requests": {"cpu": "1", "memory": "4Gi"},
    "limits": {"cpu": "1", "memory": "4Gi"},
}
"""CPU mode: the memory limit is the planner's budget for weights, activations and KV cache.
Limits equal requests, so a namespace ResourceQuota that requires limits admits the pods (and
they get the Guaranteed QoS class)."""

DEFAULT_GPU_RESOURCES = {
    "requests": {"cpu": "4", "memory": "16Gi"},
    "limits": {"cpu": "4", "memory": "16Gi"},
}
"""GPU mode: host CPU and memory for the tokenizer, the API server and loading weights; limits
as in CPU mode."""

DEFAULT_ACCESS_MODE = ACCESS_MODES[0]
"""A created model cache claim's access mode when ``spec.modelCache.accessMode`` is unset
(``ReadWriteOnce``; not a CRD default, which a CEL rule would then refuse without a class)."""

HF_TOKEN_DEFAULT_KEY = default("model.hfTokenSecretRef.key")

_HF_SOURCE = re.compile(f"^{HF_SOURCE}$")
_FILE_SOURCE = re.compile(f"^{FILE_SOURCE}$")
_PVC_SOURCE = re.compile(f"^{PVC_SOURCE}$")
_QUANTITY = re.compile(r"^[+]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][-+]?[0-9]+|[KMGTPE]i?|[mkMGTPE])?$")


class SpecError(ValueError):
    """A spec field is invalid. ``field`` is its path (``spec.gpu.type``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class ModelSource:
    """``spec.model``.

    Attributes:
        source: the source as written (None: the built-in default model).
        scheme: ``"default"``, ``"hf"``, ``"file"`` or ``"pvc"``.
        location: hub repo id (hf), absolute path (file), or path inside the claim (pvc, "" for
            its root); None for the default.
        claim_name: the PersistentVolumeClaim of a ``pvc://`` source.
        revision: hub branch, tag or commit.
        served_model_name: the name the API reports.
        hf_token_secret_name: Secret holding a Hugging Face token, if any.
        hf_token_secret_key: the key in that Secret.
        config: an inline config.json (``spec.model.config``): sizes the model without reading
            the source (required for ``pvc://``, which the operator cannot read).
    """

    source: str | None = None
    scheme: str = "default"
    location: str | None = None
    claim_name: str | None = None
    revision: str | None = None
    served_model_name: str | None = None
    hf_token_secret_name: str | None = None
    hf_token_secret_key: str = HF_TOKEN_DEFAULT_KEY
    config: dict[str, Any] | None = None

    @property
    def display_name(self) -> str:
        """The model for people (``status.model``, the ``Model`` printer column)."""
        if self.scheme == "default":
            return f"{DEFAULT_MODEL_NAME} (built-in)"
        if self.scheme == "pvc":
            return "/".join(filter(None, (self.claim_name, self.location)))
        return self.location


@dataclass(frozen=True)
class EngineSpec:
    """``spec.engine``: engine settings (vLLM names); None = the planner's or engine's default."""

    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    dtype: str = default("engine.dtype")
    kv_cache_dtype: str = default("engine.kvCacheDtype")
    quantization: str | None = None
    enable_prefix_caching: bool | None = None
    enable_chunked_prefill: bool | None = None
    speculative_config: dict[str, Any] | None = None
    extra_args: tuple[str, ...] = ()


@dataclass(frozen=True)
class GpuSpec:
    """``spec.gpu``: which GPUs a replica asks for."""

    type: str
    resource_name: str = DEFAULT_RESOURCE_NAME
    per_node: int | None = None
    memory_gib: float | None = None

    def gpu_type(self) -> GpuType:
        """The catalogue entry (or custom type) with ``perNode`` applied."""
        return gpu_type(self.type, memory_gib=self.memory_gib, per_node=self.per_node)


@dataclass(frozen=True)
class AutoscalingSpec:
    """``spec.autoscaling``; None = the autoscaler's default (operator/autoscaler.py).

    The fields are the schema's (``crd.SPEC_SCHEMA``), in snake_case
    (``tests/operator/test_crd_source.py`` holds them to it)."""

    mode: str = default("autoscaling.mode")
    min_replicas: int = default("autoscaling.minReplicas")
    max_replicas: int = 1
    target_kv_cache_usage: float | None = None
    target_waiting_requests: float | None = None
    idle_seconds: float | None = None
    scale_up_stabilization_seconds: float | None = None
    scale_down_stabilization_seconds: float | None = None
    panic_window_seconds: float | None = None
    stable_window_seconds: float | None = None
    max_scale_up_rate: float | None = None
    max_scale_down_rate: float | None = None
    gpu_budget: int | None = None
    predictive_scaling: bool = default("autoscaling.predictiveScaling")
    tune_engine: bool = False
    allow_kv_cache_dtype: bool = default("autoscaling.allowKvCacheDtype")
    allowed_gpu_types: tuple[str, ...] = ()


@dataclass(frozen=True)
class ModelCacheSpec:
    """``spec.modelCache``: an existing claim, a claim the operator creates, or an emptyDir."""

    claim_name: str | None = None
    size: str | None = None
    storage_class_name: str | None = None
    access_mode: str = DEFAULT_ACCESS_MODE

    @property
    def creates_claim(self) -> bool:
        """Whether the operator creates a PersistentVolumeClaim (size and storage class)."""
        return self.claim_name is None and self.storage_class_name is not None


@dataclass(frozen=True)
class Adapter:
    """One LoRA adapter of ``spec.adapters``."""

    name: str
    source: str


@dataclass(frozen=True)
class RouterSpec:
    """``spec.router``: whether the operator deploys the router, and its wake timeout (s)."""

    enabled: bool = True
    wake_timeout_seconds: int = 300


@dataclass(frozen=True)
class LLMDeploymentSpec:
    """A parsed, validated ``LLMDeployment`` spec. ``gpu`` None means CPU mode."""

    model: ModelSource
    engine: EngineSpec
    gpu: GpuSpec | None
    replicas: int
    tensor_parallel_size: int | None = None
    gpu_memory_utilization: float | None = None
    autoscaling: AutoscalingSpec | None = None
    image: str = ENGINE_IMAGE
    resources: dict[str, dict[str, str]] | None = None
    env: tuple[dict[str, Any], ...] = ()
    node_selector: dict[str, str] | None = None
    tolerations: tuple[dict[str, Any], ...] = ()
    affinity: dict[str, Any] | None = None
    model_cache: ModelCacheSpec | None = None
    adapters: tuple[Adapter, ...] = ()
    router: RouterSpec = RouterSpec()

    @property
    def memory_limit_bytes(self) -> int | None:
        """The container's memory limit, else its request, in bytes (None if neither is set)."""
        from kubernetes.utils.quantity import parse_quantity

        resources = self.resources or {}
        limit = resources.get("limits", {}).get("memory")
        quantity = limit or resources.get("requests", {}).get("memory")
        return None if quantity is None else int(parse_quantity(quantity))


def validate_name(name: str) -> None:
    """Check an ``LLMDeployment`` name: it names a Service, so a DNS-1035 label (<= 63 chars).

    Raises:
        SpecError: for ``metadata.name``.
    """
    if not isinstance(name, str) or len(name) > NAME_MAX_LENGTH or not re.match(DNS_1035, name):
        raise SpecError(
            "metadata.name",
            f"{name!r} must be a DNS-1035 label (lowercase letters, digits, '-', starting with "
            f"a letter, at most {NAME_MAX_LENGTH} characters): it names the Service",
        )


def parse_spec(spec: dict[str, Any]) -> LLMDeploymentSpec:
    """Validate an ``LLMDeployment``'s ``spec`` and fill in defaults.

    Raises:
        SpecError: the first invalid field, with its path and what was expected.
    """
    r = _Reader(spec, "spec", SPEC_SCHEMA)
    r.only()
    gpu = _gpu(r.child("gpu"))
    tp = r.int("tensorParallelSize")
    if gpu is None and tp not in (None, 1):
        raise SpecError("spec.tensorParallelSize", "CPU mode (no spec.gpu) runs one process: 1")
    utilization = r.number("gpuMemoryUtilization")
    if gpu is None and utilization is not None:
        raise SpecError("spec.gpuMemoryUtilization", "only meaningful with spec.gpu")
    autoscaling = _autoscaling(r.child("autoscaling"))
    replicas = r.int("replicas")
    resources = _resources(r.child("resources"))
    if resources is None:
        resources = DEFAULT_CPU_RESOURCES if gpu is None else DEFAULT_GPU_RESOURCES
    if gpu is None and not any("memory" in part for part in resources.values()):
        raise SpecError(
            "spec.resources.limits.memory",
            "required in CPU mode (no spec.gpu): the planner sizes the KV cache from it",
        )
    parsed = LLMDeploymentSpec(
        model=_model(r.child("model")),
        engine=_engine(r.child("engine")),
        gpu=gpu,
        replicas=replicas,
        tensor_parallel_size=tp,
        gpu_memory_utilization=utilization,
        autoscaling=autoscaling,
        image=r.str("image") or ENGINE_IMAGE,
        resources=resources,
        env=tuple(r.list("env", _env)),
        node_selector=r.string_map("nodeSelector"),
        tolerations=tuple(r.list("tolerations", lambda item: item.as_object())),
        affinity=r.object("affinity"),
        model_cache=_model_cache(r.child("modelCache")),
        adapters=_adapters(r),
        router=_router(r.child("router")),
    )
    if gpu is None and not parsed.memory_limit_bytes:
        raise SpecError(
            "spec.resources.limits.memory",
            "must be more than 0 in CPU mode (no spec.gpu): the planner sizes the KV cache from it",
        )
    return parsed


def parse_autoscaling(
    autoscaling: dict[str, Any], path: str = "spec.autoscaling"
) -> AutoscalingSpec:
    """Validate one ``spec.autoscaling`` object (camelCase keys) and fill in the CRD's defaults,
    as :func:`parse_spec` does.

    Args:
        autoscaling: the object.
        path: its path, which every error's field starts with.

    Raises:
        SpecError: the first invalid field, with its path and what was expected.
    """
    return _autoscaling(_Reader(autoscaling, path, field_schema("autoscaling")))


def _model(r: _Reader | None) -> ModelSource:
    if r is None:
        return ModelSource()
    r.only()
    # Its pattern is the three schemes' below, which tell a clearer error than one pattern.
    source = r.str("source", check_pattern=False)
    revision = r.str("revision")
    secret = r.child("hfTokenSecretRef")
    secret_name = secret_key = None
    if secret is not None:
        secret.only()
        secret_name = secret.str("name")
        secret_key = secret.str("key")
    fields = {
        "source": source,
        "revision": revision,
        "served_model_name": r.str("servedModelName"),
        "hf_token_secret_name": secret_name,
        "hf_token_secret_key": secret_key or HF_TOKEN_DEFAULT_KEY,
        "config": r.object("config"),
    }
    hf = _HF_SOURCE.match(source or "")
    if revision is not None and hf is None:
        raise SpecError("spec.model.revision", "only meaningful for hf:// sources")
    if source is None:
        return ModelSource(**fields)
    if hf is not None:
        return ModelSource(scheme="hf", location=hf.group(1), **fields)
    if match := _FILE_SOURCE.match(source):
        return ModelSource(scheme="file", location=match.group(1), **fields)
    if match := _PVC_SOURCE.match(source):
        path = (match.group(3) or "").strip("/")
        if fields["config"] is None:
            raise SpecError(
                "spec.model.config",
                "required for pvc:// sources: the operator cannot read a claim's files, so "
                "give the model's config.json here to size it",
            )
        return ModelSource(scheme="pvc", location=path, claim_name=match.group(1), **fields)
    raise SpecError(
        "spec.model.source",
        f"{source!r} is not hf://org/name, file:///absolute/path or pvc://claim/path "
        "(omit the field for the built-in default model)",
    )


def _engine(r: _Reader | None) -> EngineSpec:
    if r is None:
        return EngineSpec()
    r.only()
    max_model_len = r.int("maxModelLen")
    batched = r.int("maxNumBatchedTokens")
    chunked = r.bool("enableChunkedPrefill")
    if chunked is False and batched is not None and max_model_len and batched < max_model_len:
        raise SpecError(
            "spec.engine.maxNumBatchedTokens",
            f"{batched} must be >= maxModelLen {max_model_len} when enableChunkedPrefill is "
            "false, or a long prompt could never be scheduled",
        )
    extra_args = tuple(r.list("extraArgs", lambda item: item.as_str()))
    for i, arg in enumerate(extra_args):
        if (flag := managed_flag(arg)) is not None:
            raise SpecError(
                f"spec.engine.extraArgs[{i}]",
                "--config could set flags the operator derives from the spec; give flags one by one"
                if flag == "--config"
                else f"{flag} is set by the operator from the spec; use the matching spec field",
            )
    return EngineSpec(
        max_model_len=max_model_len,
        max_num_seqs=r.int("maxNumSeqs"),
        max_num_batched_tokens=batched,
        dtype=r.enum("dtype"),
        kv_cache_dtype=r.enum("kvCacheDtype"),
        quantization=r.enum("quantization"),
        enable_prefix_caching=r.bool("enablePrefixCaching"),
        enable_chunked_prefill=chunked,
        speculative_config=r.object("speculativeConfig"),
        extra_args=extra_args,
    )


def _gpu(r: _Reader | None) -> GpuSpec | None:
    if r is None:
        return None
    r.only()
    kind = r.enum("type")
    memory = r.number("memoryGiB")
    if kind == CUSTOM and memory is None:
        raise SpecError("spec.gpu.memoryGiB", "required when spec.gpu.type is custom")
    if kind != CUSTOM and memory is not None:
        raise SpecError("spec.gpu.memoryGiB", f"only for type custom; {kind} has known memory")
    return GpuSpec(
        type=kind,
        resource_name=r.str("resourceName"),
        per_node=r.int("perNode"),
        memory_gib=memory,
    )


def _autoscaling(r: _Reader | None) -> AutoscalingSpec | None:
    if r is None:
        return None
    r.only()
    min_replicas = r.int("minReplicas")
    max_replicas = r.int("maxReplicas")
    if min_replicas > max_replicas:
        raise SpecError(
            f"{r.path}.minReplicas", f"{min_replicas} must be <= maxReplicas {max_replicas}"
        )
    panic = r.number("panicWindowSeconds")
    stable = r.number("stableWindowSeconds")
    if panic is not None and stable is not None and panic > stable:
        raise SpecError(
            f"{r.path}.panicWindowSeconds", f"{panic} must be <= stableWindowSeconds {stable}"
        )
    allowed = r.list("allowedGpuTypes", lambda item: item.as_enum())
    return AutoscalingSpec(
        mode=r.enum("mode"),
        min_replicas=min_replicas,
        max_replicas=max_replicas,
        target_kv_cache_usage=r.number("targetKVCacheUsage"),
        target_waiting_requests=r.number("targetWaitingRequests"),
        idle_seconds=r.number("idleSeconds"),
        scale_up_stabilization_seconds=r.number("scaleUpStabilizationSeconds"),
        scale_down_stabilization_seconds=r.number("scaleDownStabilizationSeconds"),
        panic_window_seconds=panic,
        stable_window_seconds=stable,
        max_scale_up_rate=r.number("maxScaleUpRate"),
        max_scale_down_rate=r.number("maxScaleDownRate"),
        gpu_budget=r.int("gpuBudget"),
        predictive_scaling=r.bool("predictiveScaling"),
        tune_engine=bool(r.bool("tuneEngine")),
        allow_kv_cache_dtype=r.bool("allowKvCacheDtype"),
        allowed_gpu_types=tuple(dict.fromkeys(allowed)),
    )


def _resources(r: _Reader | None) -> dict[str, dict[str, str]] | None:
    if r is None:
        return None
    r.only()
    out = {}
    for part in ("requests", "limits"):
        section = r.child(part)
        if section is None:
            continue
        section.only()
        out[part] = {key: section.quantity(key) for key in RESOURCE_KEYS if key in section.raw}
    return out


def _model_cache(r: _Reader | None) -> ModelCacheSpec | None:
    if r is None:
        return None
    r.only()
    claim = r.str("claimName")
    access_mode = r.enum("accessMode")
    size = r.quantity("size") if "size" in r.raw else None
    storage_class = r.str("storageClassName")
    if claim is not None and (size is not None or storage_class is not None):
        raise SpecError(
            "spec.modelCache.claimName",
            "an existing claim excludes size and storageClassName (those create a new one)",
        )
    if storage_class is not None and size is None:
        raise SpecError("spec.modelCache.size", "required with storageClassName")
    if access_mode is not None and storage_class is None:
        raise SpecError(
            "spec.modelCache.accessMode",
            "is for a claim the operator creates (with storageClassName)",
        )
    return ModelCacheSpec(
        claim_name=claim,
        size=size,
        storage_class_name=storage_class,
        access_mode=access_mode or DEFAULT_ACCESS_MODE,
    )


def _router(r: _Reader | None) -> RouterSpec:
    if r is None:
        return RouterSpec()
    r.only()
    enabled, timeout = r.bool("enabled"), r.int("wakeTimeoutSeconds")
    return RouterSpec(
        enabled=RouterSpec.enabled if enabled is None else enabled,
        wake_timeout_seconds=RouterSpec.wake_timeout_seconds if timeout is None else timeout,
    )


def _adapters(r: _Reader) -> tuple[Adapter, ...]:
    def adapter(item: _Reader) -> Adapter:
        item.only()
        return Adapter(name=item.str("name"), source=item.str("source"))

    adapters = r.list("adapters", adapter)
    names = [a.name for a in adapters]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise SpecError(f"spec.adapters[{i}].name", f"duplicate adapter name {name!r}")
    return tuple(adapters)


def _env(item: _Reader) -> dict[str, Any]:
    item.str("name")
    return item.raw


class _Reader:
    """Typed access to one object of the spec, checked against its schema (a node of
    ``crd.SPEC_SCHEMA``): known fields, required ones, types, ranges, enums, patterns and
    defaults come from there. Every error carries the field's path."""

    def __init__(self, raw: Any, path: str, schema: dict) -> None:
        if not isinstance(raw, dict):
            raise SpecError(path, f"must be an object, got {_kind(raw)}")
        self.raw = raw
        self.path = path
        self.schema = schema

    def _field(self, key: str) -> dict:
        return self.schema["properties"][key]

    def only(self) -> None:
        known = self.schema["properties"]
        for key in self.raw:
            if key not in known:
                raise SpecError(f"{self.path}.{key}", f"unknown field; known: {', '.join(known)}")

    def child(self, key: str) -> _Reader | None:
        value = self.raw.get(key)
        return None if value is None else _Reader(value, f"{self.path}.{key}", self._field(key))

    def _value(self, key: str) -> Any:
        """The field's value, else its schema default (None without one).

        Raises:
            SpecError: a field the schema requires is absent.
        """
        value = self.raw.get(key)
        if value is None and key in self.schema.get("required", ()):
            raise SpecError(f"{self.path}.{key}", "required")
        return self._field(key).get("default") if value is None else value

    def str(self, key: str, *, check_pattern: bool = True) -> Any:
        value = self._value(key)
        if value is None:
            return None
        if not isinstance(value, str) or not value:
            raise SpecError(f"{self.path}.{key}", f"must be a non-empty string, got {value!r}")
        pattern = self._field(key).get("pattern") if check_pattern else None
        if pattern is not None and not re.match(pattern, value):
            raise SpecError(f"{self.path}.{key}", f"{value!r} does not match {pattern}")
        return value

    def enum(self, key: str) -> Any:
        value = self._value(key)
        choices = self._field(key)["enum"]
        if value is not None and value not in choices:
            raise SpecError(f"{self.path}.{key}", f"{value!r} is not one of {', '.join(choices)}")
        return value

    def int(self, key: str) -> Any:
        value = self._value(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise SpecError(f"{self.path}.{key}", f"must be an integer, got {value!r}")
        _check_range(f"{self.path}.{key}", value, self._field(key))
        return value

    def number(self, key: str) -> Any:
        value = self._value(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise SpecError(f"{self.path}.{key}", f"must be a number, got {value!r}")
        _check_range(f"{self.path}.{key}", value, self._field(key))
        return float(value)

    def bool(self, key: str) -> bool | None:
        value = self._value(key)
        if value is not None and not isinstance(value, bool):
            raise SpecError(f"{self.path}.{key}", f"must be true or false, got {value!r}")
        return value

    def object(self, key: str) -> dict[str, Any] | None:
        child = self.child(key)
        return None if child is None else child.raw

    def string_map(self, key: str) -> dict[str, str] | None:
        child = self.child(key)
        if child is None:
            return None
        for k, v in child.raw.items():
            if not isinstance(v, str):
                raise SpecError(f"{child.path}.{k}", f"must be a string, got {v!r}")
        return child.raw

    def quantity(self, key: str) -> str:
        value = self.raw.get(key)
        text = (
            str(value) if isinstance(value, int | float) and not isinstance(value, bool) else value
        )
        if not isinstance(text, str) or not _QUANTITY.match(text):
            raise SpecError(
                f"{self.path}.{key}", f"{value!r} is not a Kubernetes quantity (e.g. 4Gi, 500m)"
            )
        return text

    def list(self, key: str, item: Callable[[_Reader], Any]) -> list[Any]:
        value = self.raw.get(key)
        if value is None:
            return []
        if not isinstance(value, list):
            raise SpecError(f"{self.path}.{key}", f"must be a list, got {_kind(value)}")
        items = self._field(key)["items"]
        return [item(_Item(v, f"{self.path}.{key}[{i}]", items)) for i, v in enumerate(value)]


class _Item(_Reader):
    """A list element, which may be a scalar; ``schema`` is the list's ``items``."""

    def __init__(self, raw: Any, path: str, schema: dict) -> None:
        self.raw = raw
        self.path = path
        self.schema = schema

    def _object(self) -> None:
        if not isinstance(self.raw, dict):
            raise SpecError(self.path, f"must be an object, got {_kind(self.raw)}")

    def only(self) -> None:
        self._object()
        super().only()

    def _value(self, key: str) -> Any:
        self._object()
        return super()._value(key)

    def as_object(self) -> dict[str, Any]:
        self._object()
        return self.raw

    def as_str(self) -> str:
        if not isinstance(self.raw, str):
            raise SpecError(self.path, f"must be a string, got {self.raw!r}")
        return self.raw

    def as_enum(self) -> str:
        choices = self.schema["enum"]
        if self.raw not in choices:
            raise SpecError(self.path, f"{self.raw!r} is not one of {', '.join(choices)}")
        return self.raw


def _check_range(path: str, value: float, schema: dict) -> None:
    """Check ``value`` against the schema's ``minimum`` (exclusive with ``exclusiveMinimum``)
    and ``maximum``.

    Raises:
        SpecError: for ``path``, out of range.
    """
    minimum, maximum = schema.get("minimum"), schema.get("maximum")
    if minimum is not None and schema.get("exclusiveMinimum") and value <= minimum:
        raise SpecError(path, f"must be > {minimum} (got {value})")
    if minimum is not None and value < minimum:
        raise SpecError(path, f"must be >= {minimum} (got {value})")
    if maximum is not None and value > maximum:
        raise SpecError(path, f"must be <= {maximum} (got {value})")


def _kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string"}.get(type(value), repr(value))
