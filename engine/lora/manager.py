"""Adapters known to the engine, the fixed slots they occupy, and each batch's token mapping.

S-LoRA (Sheng et al. 2023) keeps many adapters on the host and only those a batch needs on the
device. Here ``max_loras`` fixed slots hold resident adapters; a batch needing one that is not
resident loads it into a free slot or, when all are taken, evicts the least recently used
adapter that no running request uses (vLLM's ``LRUCacheWorkerLoRAManager``). The host keeps the
weights of at most ``max_cpu_loras`` registered adapters (vLLM's ``--max-cpu-loras``), least
recently used dropped first but never one an unfinished request uses; a dropped adapter stays
registered and is read again from its path when a request names it (and is unloaded if its
files are gone by then).
"""

from __future__ import annotations

import pathlib
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence

import torch
from torch import nn

from kvpilot.engine.distributed import get_tensor_model_parallel_world_size
from kvpilot.engine.lora.adapter import (
    SUPPORTED_TARGETS,
    LoRAAdapter,
    load_adapter,
    missing_adapter_files,
)
from kvpilot.engine.lora.errors import LoRAAdapterError, LoRAAdapterGoneError
from kvpilot.engine.lora.layers import LinearWithLoRA, LoRABatchMapping, wrap_lora_layers
from kvpilot.engine.lora.request import LoRARequest


class LoRASlotsBusyError(RuntimeError):
    """Every slot holds an adapter that a running request uses; nothing can be evicted."""


class LoRAInUseError(ValueError):
    """An adapter cannot be removed while unfinished requests use it."""


class LoRAManager:
    """The LoRA state of one model: registered adapters, the host copies of their weights and
    the resident slots (device).

    Wraps the model's q/k/v/o and gate/up/down projections at construction (call it after the
    weights are loaded).

    Args:
        model: a loaded model with ``stacked_params_mapping`` (the Llama family).
        max_loras: slots: adapters resident at once (and distinct adapters in one batch).
        max_lora_rank: the largest adapter rank accepted.
        use_kernels: Triton kernels (True) or PyTorch (False) for the delta; None: the kernels
            on a CUDA device only.
        max_cpu_loras: adapters whose weights stay in host memory (vLLM's
            ``--max-cpu-loras``); None: ``max_loras``, as in vLLM.
        in_use: the adapter names of the unfinished requests (the engine's output processor),
            whose host copies are never dropped: a request admitted with its adapter read then
            never needs it read again, so a folder deleted or changed later cannot fail a step
            (vLLM's engine would die of it). None: only a batch's own adapters are kept.
        lora_dtype: the dtype of the adapters' weights, on the host and in the slots (vLLM's
            ``--lora-dtype``); None: the model's.

    Attributes:
        requests: the registered adapters by name, in registration order.
        adapters: the host copies of their weights (at most ``max_cpu_loras``), least
            recently used (registered, or run in a batch) first.

    Raises:
        ValueError: ``max_loras`` or ``max_lora_rank`` not a positive integer, ``max_cpu_loras``
            below ``max_loras``, or a model sharded over several tensor-parallel ranks.
    """

    def __init__(
        self,
        model: nn.Module,
        max_loras: int,
        max_lora_rank: int,
        use_kernels: bool | None = None,
        *,
        max_cpu_loras: int | None = None,
        lora_dtype: torch.dtype | None = None,
        in_use: Callable[[], Collection[str | None]] | None = None,
    ) -> None:
        for name, value in (("max_loras", max_loras), ("max_lora_rank", max_lora_rank)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        max_cpu_loras = max_loras if max_cpu_loras is None else max_cpu_loras
        if not isinstance(max_cpu_loras, int) or max_cpu_loras < max_loras:
            # vLLM's LoRAConfig wording.
            raise ValueError(f"max_cpu_loras ({max_cpu_loras}) must be >= max_loras ({max_loras})")
        if get_tensor_model_parallel_world_size() > 1:
            raise ValueError("LoRA adapters are not supported with tensor parallelism yet")
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        self._in_use = in_use
        self.stacked_params_mapping = tuple(model.stacked_params_mapping)
        self.device = next(model.parameters()).device
        self.lora_dtype = lora_dtype or next(
            p.dtype for p in model.parameters() if p.is_floating_point()
        )
        self.mapping = LoRABatchMapping(max_loras, use_kernels)
        self.layers: dict[str, LinearWithLoRA] = wrap_lora_layers(
            model,
            self.stacked_params_mapping,
            SUPPORTED_TARGETS,
            lambda base, shard_ids: LinearWithLoRA(
                base, shard_ids, max_loras, max_lora_rank, self.mapping, self.lora_dtype
            ),
        )
        self.requests: dict[str, LoRARequest] = {}
        self.adapters: OrderedDict[str, LoRAAdapter] = OrderedDict()
        # Each registered adapter's local folder (a Hub id's download) and digest when it was
        # first read: a dropped copy is read again from there, and must match.
        self._sources: dict[str, tuple[pathlib.Path, str]] = {}
        # Resident adapter name -> slot, least recently used first.
        self._slots: OrderedDict[str, int] = OrderedDict()

    @property
    def resident(self) -> list[str]:
        """Names of the adapters in slots, least recently used first."""
        return list(self._slots)

    def add_adapter(self, request: LoRARequest) -> LoRAAdapter:
        """Register an adapter (read and checked now; copied into a slot when a batch needs it).

        Registering the same name and path again returns its host copy (read again if it was
        dropped), now the most recently used. Keeping it may drop the least recently used
        other adapter's host copy (``max_cpu_loras``).

        Raises:
            LoRAAdapterError: the folder cannot be read or does not fit the model (a target it
                lacks, other feature sizes, a rank above ``max_lora_rank``), the name is
                registered with another path (remove it first), or a dropped adapter's files
                changed since it was registered or are gone (``LoRAAdapterGoneError``; the
                adapter is then unregistered).
        """
        known = self.requests.get(request.lora_name)
        if known is not None:
            if known.lora_path != request.lora_path:
                raise LoRAAdapterError(
                    f"LoRA adapter {request.lora_name!r} is already loaded from "
                    f"{known.lora_path}; unload it before loading it from {request.lora_path}"
                )
            return self._host_copy(request.lora_name, pinned=())
        adapter = self._read(request.lora_name, request.lora_path)
        self.requests[request.lora_name] = request
        self._sources[request.lora_name] = (adapter.path, adapter.digest)
        self._keep(adapter, pinned=())
        return adapter

    def remove_adapter(self, name: str, in_use: Collection[str] = ()) -> bool:
        """Forget an adapter and free its slot; returns whether it was registered.

        Args:
            name: the adapter.
            in_use: adapters of unfinished requests.

        Raises:
            LoRAInUseError: an unfinished request uses it (``name in in_use``).
        """
        if name in in_use:
            raise LoRAInUseError(f"LoRA adapter {name!r} is used by unfinished requests")
        self._slots.pop(name, None)
        self.adapters.pop(name, None)
        self._sources.pop(name, None)
        return self.requests.pop(name, None) is not None

    def set_batch(
        self,
        adapter_names: Sequence[str | None],
        num_tokens: Sequence[int],
        in_use: Collection[str] = (),
    ) -> None:
        """Make the batch's adapters resident and map its tokens to their slots.

        Args:
            adapter_names: per sequence of the batch, its adapter's name or None (base model).
            num_tokens: per sequence, its new tokens in this pass (they are contiguous, in
                sequence order, as in the model runner's flat batch).
            in_use: adapters of running requests outside this batch: not evicted.

        Raises:
            KeyError: an adapter that is not registered.
            LoRASlotsBusyError: the batch's adapters and ``in_use`` leave no slot to evict.
            LoRAAdapterError: a dropped host copy that cannot be read again
                (``LoRAAdapterGoneError``: its files are gone, and the adapter is unregistered).
        """
        names = [n for n in dict.fromkeys(adapter_names) if n is not None]
        if len(names) > self.max_loras:
            raise LoRASlotsBusyError(
                f"a batch uses {len(names)} LoRA adapters; max_loras is {self.max_loras}"
            )
        pinned = set(names) | set(in_use)
        for name in names:  # run now: the most recently used host copies
            if name in self.adapters:
                self.adapters.move_to_end(name)
        slot_of = {name: self._make_resident(name, pinned) for name in names}
        slots = [-1 if n is None else slot_of[n] for n in adapter_names]
        token_slots = torch.repeat_interleave(
            torch.tensor(slots, dtype=torch.int32), torch.tensor(num_tokens, dtype=torch.int64)
        )
        self.mapping.set(token_slots, self.device)

    def _make_resident(self, name: str, pinned: set[str]) -> int:
        if name not in self.requests:
            raise KeyError(f"LoRA adapter {name!r} is not loaded")
        if name in self._slots:
            self._slots.move_to_end(name)
            return self._slots[name]
        free = sorted(set(range(self.max_loras)) - set(self._slots.values()))
        if free:
            slot = free[0]
        else:
            victim = next((n for n in self._slots if n not in pinned), None)
            if victim is None:
                raise LoRASlotsBusyError(
                    f"cannot load LoRA adapter {name!r}: all {self.max_loras} slots hold "
                    f"adapters of running requests"
                )
            slot = self._slots.pop(victim)
        weights = self._host_copy(name, pinned).by_projection()
        for module, layer in self.layers.items():
            layer.set_slot(slot, weights.get(module, {}))
        self._slots[name] = slot
        return slot

    def _read(self, name: str, path: str | pathlib.Path) -> LoRAAdapter:
        """The adapter's weights read from ``path`` in ``lora_dtype``, checked against the
        model."""
        adapter = load_adapter(name, path, self.stacked_params_mapping, self.lora_dtype)
        self._check(adapter)
        return adapter

    def _host_copy(self, name: str, pinned: Collection[str]) -> LoRAAdapter:
        """A registered adapter's host copy, now the most recently used; read again if it was
        dropped (its files must be those registered: the prefix cache keys on their digest).

        A dropped adapter whose files are gone is unregistered (``LoRAAdapterGoneError``), so
        that its name can be loaded again, from any path (with ``in_use``, no unfinished request
        uses it: their host copies are never dropped)."""
        adapter = self.adapters.get(name)
        if adapter is not None:
            self.adapters.move_to_end(name)
            return adapter
        folder, digest = self._sources[name]
        missing = missing_adapter_files(folder)
        if missing:
            self.remove_adapter(name)
            raise LoRAAdapterGoneError(
                f"LoRA adapter {name!r}: its files are gone from {folder} ({', '.join(missing)} "
                "deleted since it was loaded), so it was unloaded; load it again to use it"
            )
        adapter = self._read(name, folder)
        if adapter.digest != digest:
            raise LoRAAdapterError(
                f"LoRA adapter {name!r}: the files in {folder} changed since it was loaded; "
                "unload it and load it again"
            )
        self._keep(adapter, pinned)
        return adapter

    def _keep(self, adapter: LoRAAdapter, pinned: Collection[str]) -> None:
        """Hold ``adapter``'s host copy as the most recently used, dropping the least recently
        used others beyond ``max_cpu_loras`` (never one in ``pinned`` or of an unfinished
        request: then the cache stays over its bound until the next drop)."""
        self.adapters[adapter.name] = adapter
        self.adapters.move_to_end(adapter.name)
        if len(self.adapters) <= self.max_cpu_loras:
            return
        kept = {adapter.name, *pinned, *(self._in_use() if self._in_use is not None else ())}
        while len(self.adapters) > self.max_cpu_loras:
            victim = next((n for n in self.adapters if n not in kept), None)
            if victim is None:
                return
            del self.adapters[victim]

    def _check(self, adapter: LoRAAdapter) -> None:
        if adapter.rank > self.max_lora_rank:
            raise LoRAAdapterError(
                f"LoRA adapter {adapter.name!r} has rank {adapter.rank}, above max_lora_rank "
                f"{self.max_lora_rank}"
            )
        for module, weights in adapter.by_projection().items():
            if module not in self.layers:
                raise LoRAAdapterError(
                    f"LoRA adapter {adapter.name!r} adapts {module!r}, which the model lacks "
                    f"(an adapter of another base model?)"
                )
            try:
                self.layers[module].check_weights(module, weights)
            except LoRAAdapterError as exc:
                raise LoRAAdapterError(f"LoRA adapter {adapter.name!r}: {exc}") from exc
