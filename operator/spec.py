"""An ``LLMDeployment``'s spec as typed values with defaults (pure).

The CRD's openAPIV3Schema and CEL rules reject bad specs at the API server; this module
enforces the same rules again (and the CEL ones, which some API servers and test emulators do
not evaluate), so the operator never acts on a spec the schema would refuse. Every error names
the field path, e.g. ``spec.autoscaling.minReplicas``.

Defaults (the CRD's, for objects that did not pass an API server): ``replicas`` 1 (the
autoscaler moves it into ``[minReplicas, maxReplicas]``), ``gpu.resourceName``
``nvidia.com/gpu``, ``gpu.perNode`` from the GPU catalogue, ``image`` ``ENGINE_IMAGE``,
``engine.dtype`` ``auto``, ``autoscaling.mode`` ``kvpilot``, ``autoscaling.minReplicas`` 1,
``hfTokenSecretRef.key`` ``token``, resources per mode (``DEFAULT_CPU_RESOURCES``,
``DEFAULT_GPU_RESOURCES``). Fields left ``None`` are decided by the planner or the engine.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvpilot.engine.model_loader import DEFAULT_MODEL_NAME
from kvpilot.operator.gpus import CATALOGUE, CUSTOM, DEFAULT_RESOURCE_NAME, GpuType, gpu_type
from kvpilot.operator.images import ENGINE_IMAGE

SPEC_DTYPES = ("auto", "float16", "bfloat16", "float32")
"""``spec.engine.dtype``'s values, as the CRD's enum (the engine also takes ``float``, ``half``)."""
AUTOSCALING_MODES = ("kvpilot", "external")
GPU_TYPES = (*CATALOGUE, CUSTOM)
"""``spec.gpu.type``'s values, spelt exactly as the CRD's enum: no case folding or aliases here
(``kvpilot plan --gpu h100`` goes through ``gpus.resolve_gpu_name``), so that every object
carries one canonical spelling that the API server, this module and selectors agree on."""
RESOURCE_KEYS = ("cpu", "memory", "ephemeral-storage")

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

ACCESS_MODES = ("ReadWriteOnce", "ReadWriteMany", "ReadWriteOncePod")
"""``spec.modelCache.accessMode`` values; a created claim is ``ReadWriteOnce`` by default."""

HF_TOKEN_DEFAULT_KEY = "token"

# Flags the operator derives from the spec and the plan; extraArgs may not repeat them, so a
# pod never receives two conflicting values.
MANAGED_FLAGS = (
    "--model",
    "--revision",
    "--served-model-name",
    "--host",
    "--port",
    "--device",
    "--dtype",
    "--tensor-parallel-size",
    "-tp",
    "--gpu-memory-utilization",
    "--kv-cache-memory",
    "--max-model-len",
    "--max-num-seqs",
    "--max-num-batched-tokens",
    "--block-size",
    "--enable-prefix-caching",
    "--no-enable-prefix-caching",
    "--enable-chunked-prefill",
    "--no-enable-chunked-prefill",
    "--speculative-config",
)

_HF_SOURCE = re.compile(r"^hf://([A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?)$")
_FILE_SOURCE = re.compile(r"^file://(/.*)$")
_PVC_SOURCE = re.compile(r"^pvc://([a-z0-9]([-a-z0-9]*[a-z0-9])?)(/.*)?$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_RESOURCE_NAME = re.compile(
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9][-A-Za-z0-9_.]*$"
)
_ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
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
    dtype: str = "auto"
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
    """``spec.autoscaling``; None = the autoscaler's default (operator/autoscaler.py)."""

    mode: str = "kvpilot"
    min_replicas: int = 1
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
    predictive_scaling: bool | None = None
    tune_engine: bool = False
    allowed_gpu_types: tuple[str, ...] = ()


@dataclass(frozen=True)
class ModelCacheSpec:
    """``spec.modelCache``: an existing claim, a claim the operator creates, or an emptyDir."""

    claim_name: str | None = None
    size: str | None = None
    storage_class_name: str | None = None
    access_mode: str = "ReadWriteOnce"

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
    if not isinstance(name, str) or len(name) > 63 or not _DNS_1035.match(name):
        raise SpecError(
            "metadata.name",
            f"{name!r} must be a DNS-1035 label (lowercase letters, digits, '-', starting with "
            "a letter, at most 63 characters): it names the Service",
        )


def parse_spec(spec: dict[str, Any]) -> LLMDeploymentSpec:
    """Validate an ``LLMDeployment``'s ``spec`` and fill in defaults.

    Raises:
        SpecError: the first invalid field, with its path and what was expected.
    """
    r = _Reader(spec, "spec")
    r.only(
        "model",
        "engine",
        "tensorParallelSize",
        "gpuMemoryUtilization",
        "gpu",
        "replicas",
        "autoscaling",
        "image",
        "resources",
        "env",
        "nodeSelector",
        "tolerations",
        "affinity",
        "modelCache",
        "adapters",
    )
    gpu = _gpu(r.child("gpu"))
    tp = r.int("tensorParallelSize", minimum=1, maximum=64)
    if gpu is None and tp not in (None, 1):
        raise SpecError("spec.tensorParallelSize", "CPU mode (no spec.gpu) runs one process: 1")
    utilization = r.number("gpuMemoryUtilization", exclusive_minimum=0, maximum=1)
    if gpu is None and utilization is not None:
        raise SpecError("spec.gpuMemoryUtilization", "only meaningful with spec.gpu")
    autoscaling = _autoscaling(r.child("autoscaling"))
    replicas = r.int("replicas", minimum=0)
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
        replicas=1 if replicas is None else replicas,
        tensor_parallel_size=tp,
        gpu_memory_utilization=utilization,
        autoscaling=autoscaling,
        image=r.str("image", pattern=re.compile(r"^\S+$")) or ENGINE_IMAGE,
        resources=resources,
        env=tuple(r.list("env", _env)),
        node_selector=r.string_map("nodeSelector"),
        tolerations=tuple(r.list("tolerations", lambda item: item.as_object())),
        affinity=r.object("affinity"),
        model_cache=_model_cache(r.child("modelCache")),
        adapters=_adapters(r),
    )
    if gpu is None and not parsed.memory_limit_bytes:
        raise SpecError(
            "spec.resources.limits.memory",
            "must be more than 0 in CPU mode (no spec.gpu): the planner sizes the KV cache from it",
        )
    return parsed


def _model(r: _Reader | None) -> ModelSource:
    if r is None:
        return ModelSource()
    r.only("source", "revision", "servedModelName", "hfTokenSecretRef", "config")
    source = r.str("source")
    revision = r.str("revision", pattern=re.compile(r"^[\w./-]+$"))
    secret = r.child("hfTokenSecretRef")
    secret_name = secret_key = None
    if secret is not None:
        secret.only("name", "key")
        secret_name = secret.str("name", required=True, pattern=_DNS_SUBDOMAIN)
        secret_key = secret.str("key", pattern=re.compile(r"^[-._a-zA-Z0-9]+$"))
    fields = {
        "source": source,
        "revision": revision,
        "served_model_name": r.str("servedModelName", pattern=re.compile(r"^\S+$")),
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
    r.only(
        "maxModelLen",
        "maxNumSeqs",
        "maxNumBatchedTokens",
        "dtype",
        "enablePrefixCaching",
        "enableChunkedPrefill",
        "speculativeConfig",
        "extraArgs",
    )
    max_model_len = r.int("maxModelLen", minimum=1)
    batched = r.int("maxNumBatchedTokens", minimum=1)
    chunked = r.bool("enableChunkedPrefill")
    if chunked is False and batched is not None and max_model_len and batched < max_model_len:
        raise SpecError(
            "spec.engine.maxNumBatchedTokens",
            f"{batched} must be >= maxModelLen {max_model_len} when enableChunkedPrefill is "
            "false, or a long prompt could never be scheduled",
        )
    extra_args = tuple(r.list("extraArgs", lambda item: item.as_str()))
    for i, arg in enumerate(extra_args):
        flag = arg.split("=", 1)[0]
        if flag in MANAGED_FLAGS:
            raise SpecError(
                f"spec.engine.extraArgs[{i}]",
                f"{flag} is set by the operator from the spec; use the matching spec field",
            )
    return EngineSpec(
        max_model_len=max_model_len,
        max_num_seqs=r.int("maxNumSeqs", minimum=1),
        max_num_batched_tokens=batched,
        dtype=r.enum("dtype", SPEC_DTYPES) or "auto",
        enable_prefix_caching=r.bool("enablePrefixCaching"),
        enable_chunked_prefill=chunked,
        speculative_config=r.object("speculativeConfig"),
        extra_args=extra_args,
    )


def _gpu(r: _Reader | None) -> GpuSpec | None:
    if r is None:
        return None
    r.only("type", "resourceName", "perNode", "memoryGiB")
    kind = r.enum("type", GPU_TYPES, required=True)
    memory = r.number("memoryGiB", exclusive_minimum=0)
    if kind == CUSTOM and memory is None:
        raise SpecError("spec.gpu.memoryGiB", "required when spec.gpu.type is custom")
    if kind != CUSTOM and memory is not None:
        raise SpecError("spec.gpu.memoryGiB", f"only for type custom; {kind} has known memory")
    return GpuSpec(
        type=kind,
        resource_name=r.str("resourceName", pattern=_RESOURCE_NAME) or DEFAULT_RESOURCE_NAME,
        per_node=r.int("perNode", minimum=1, maximum=64),
        memory_gib=memory,
    )


def _autoscaling(r: _Reader | None) -> AutoscalingSpec | None:
    if r is None:
        return None
    r.only(
        "mode",
        "minReplicas",
        "maxReplicas",
        "targetKVCacheUsage",
        "targetWaitingRequests",
        "idleSeconds",
        "scaleUpStabilizationSeconds",
        "scaleDownStabilizationSeconds",
        "panicWindowSeconds",
        "stableWindowSeconds",
        "maxScaleUpRate",
        "maxScaleDownRate",
        "gpuBudget",
        "predictiveScaling",
        "tuneEngine",
        "allowedGpuTypes",
    )
    min_replicas = r.int("minReplicas", minimum=0)
    min_replicas = 1 if min_replicas is None else min_replicas
    max_replicas = r.int("maxReplicas", minimum=1, required=True)
    if min_replicas > max_replicas:
        raise SpecError(
            "spec.autoscaling.minReplicas",
            f"{min_replicas} must be <= maxReplicas {max_replicas}",
        )
    panic = r.number("panicWindowSeconds", exclusive_minimum=0)
    stable = r.number("stableWindowSeconds", exclusive_minimum=0)
    if panic is not None and stable is not None and panic > stable:
        raise SpecError(
            "spec.autoscaling.panicWindowSeconds",
            f"{panic} must be <= stableWindowSeconds {stable}",
        )
    allowed = r.list("allowedGpuTypes", lambda item: item.as_enum(GPU_TYPES))
    return AutoscalingSpec(
        mode=r.enum("mode", AUTOSCALING_MODES) or "kvpilot",
        min_replicas=min_replicas,
        max_replicas=max_replicas,
        target_kv_cache_usage=r.number("targetKVCacheUsage", exclusive_minimum=0, maximum=1),
        target_waiting_requests=r.number("targetWaitingRequests", minimum=0),
        idle_seconds=r.number("idleSeconds", minimum=0),
        scale_up_stabilization_seconds=r.number("scaleUpStabilizationSeconds", minimum=0),
        scale_down_stabilization_seconds=r.number("scaleDownStabilizationSeconds", minimum=0),
        panic_window_seconds=panic,
        stable_window_seconds=stable,
        max_scale_up_rate=r.number("maxScaleUpRate", exclusive_minimum=1),
        max_scale_down_rate=r.number("maxScaleDownRate", exclusive_minimum=1),
        gpu_budget=r.int("gpuBudget", minimum=0),
        predictive_scaling=r.bool("predictiveScaling"),
        tune_engine=bool(r.bool("tuneEngine")),
        allowed_gpu_types=tuple(dict.fromkeys(allowed)),
    )


def _resources(r: _Reader | None) -> dict[str, dict[str, str]] | None:
    if r is None:
        return None
    r.only("requests", "limits")
    out = {}
    for part in ("requests", "limits"):
        section = r.child(part)
        if section is None:
            continue
        section.only(*RESOURCE_KEYS)
        out[part] = {key: section.quantity(key) for key in RESOURCE_KEYS if key in section.raw}
    return out


def _model_cache(r: _Reader | None) -> ModelCacheSpec | None:
    if r is None:
        return None
    r.only("claimName", "size", "storageClassName", "accessMode")
    claim = r.str("claimName", pattern=_DNS_SUBDOMAIN)
    access_mode = r.enum("accessMode", ACCESS_MODES)
    size = r.quantity("size") if "size" in r.raw else None
    storage_class = r.str("storageClassName", pattern=_DNS_SUBDOMAIN)
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
        access_mode=access_mode or "ReadWriteOnce",
    )


def _adapters(r: _Reader) -> tuple[Adapter, ...]:
    def adapter(item: _Reader) -> Adapter:
        item.only("name", "source")
        return Adapter(
            name=item.str("name", required=True, pattern=_DNS_LABEL),
            source=item.str("source", required=True, pattern=re.compile(r"^(hf|file|pvc)://.+")),
        )

    adapters = r.list("adapters", adapter)
    names = [a.name for a in adapters]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise SpecError(f"spec.adapters[{i}].name", f"duplicate adapter name {name!r}")
    return tuple(adapters)


def _env(item: _Reader) -> dict[str, Any]:
    item.str("name", required=True, pattern=_ENV_NAME)
    return item.raw


class _Reader:
    """Typed access to one object of the spec; every error carries the field's path."""

    def __init__(self, raw: Any, path: str) -> None:
        if not isinstance(raw, dict):
            raise SpecError(path, f"must be an object, got {_kind(raw)}")
        self.raw = raw
        self.path = path

    def only(self, *keys: str) -> None:
        for key in self.raw:
            if key not in keys:
                raise SpecError(f"{self.path}.{key}", f"unknown field; known: {', '.join(keys)}")

    def child(self, key: str) -> _Reader | None:
        value = self.raw.get(key)
        return None if value is None else _Reader(value, f"{self.path}.{key}")

    def _value(self, key: str, required: bool) -> Any:
        value = self.raw.get(key)
        if value is None and required:
            raise SpecError(f"{self.path}.{key}", "required")
        return value

    def str(self, key: str, *, required: bool = False, pattern: re.Pattern | None = None) -> Any:
        value = self._value(key, required)
        if value is None:
            return None
        if not isinstance(value, str) or not value:
            raise SpecError(f"{self.path}.{key}", f"must be a non-empty string, got {value!r}")
        if pattern is not None and not pattern.match(value):
            raise SpecError(f"{self.path}.{key}", f"{value!r} does not match {pattern.pattern}")
        return value

    def enum(self, key: str, choices: tuple[str, ...], *, required: bool = False) -> Any:
        value = self._value(key, required)
        if value is not None and value not in choices:
            raise SpecError(f"{self.path}.{key}", f"{value!r} is not one of {', '.join(choices)}")
        return value

    def int(
        self,
        key: str,
        *,
        required: bool = False,
        minimum: int | None = None,
        maximum: int | None = None,
    ) -> Any:
        value = self._value(key, required)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise SpecError(f"{self.path}.{key}", f"must be an integer, got {value!r}")
        _check_range(f"{self.path}.{key}", value, minimum=minimum, maximum=maximum)
        return value

    def number(
        self,
        key: str,
        *,
        minimum: float | None = None,
        exclusive_minimum: float | None = None,
        maximum: float | None = None,
    ) -> Any:
        value = self._value(key, False)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise SpecError(f"{self.path}.{key}", f"must be a number, got {value!r}")
        _check_range(
            f"{self.path}.{key}",
            value,
            minimum=minimum,
            exclusive_minimum=exclusive_minimum,
            maximum=maximum,
        )
        return float(value)

    def bool(self, key: str) -> bool | None:
        value = self._value(key, False)
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
        return [item(_Item(v, f"{self.path}.{key}[{i}]")) for i, v in enumerate(value)]


class _Item(_Reader):
    """A list element, which may be a scalar."""

    def __init__(self, raw: Any, path: str) -> None:
        self.raw = raw
        self.path = path

    def _object(self) -> None:
        if not isinstance(self.raw, dict):
            raise SpecError(self.path, f"must be an object, got {_kind(self.raw)}")

    def only(self, *keys: str) -> None:
        self._object()
        super().only(*keys)

    def _value(self, key: str, required: bool) -> Any:
        self._object()
        return super()._value(key, required)

    def as_object(self) -> dict[str, Any]:
        self._object()
        return self.raw

    def as_str(self) -> str:
        if not isinstance(self.raw, str):
            raise SpecError(self.path, f"must be a string, got {self.raw!r}")
        return self.raw

    def as_enum(self, choices: tuple[str, ...]) -> str:
        if self.raw not in choices:
            raise SpecError(self.path, f"{self.raw!r} is not one of {', '.join(choices)}")
        return self.raw


def _check_range(
    path: str,
    value: float,
    *,
    minimum: float | None = None,
    exclusive_minimum: float | None = None,
    maximum: float | None = None,
) -> None:
    if minimum is not None and value < minimum:
        raise SpecError(path, f"must be >= {minimum} (got {value})")
    if exclusive_minimum is not None and value <= exclusive_minimum:
        raise SpecError(path, f"must be > {exclusive_minimum} (got {value})")
    if maximum is not None and value > maximum:
        raise SpecError(path, f"must be <= {maximum} (got {value})")


def _kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string"}.get(type(value), repr(value))
