"""The names a request's ``model`` may take: the base model's and the loaded LoRA adapters'.

Named after vLLM's ``OpenAIServingModels``: ``/v1/models`` lists both (an adapter's ``parent``
is the base model), and ``/v1/load_lora_adapter`` / ``/v1/unload_lora_adapter`` change the
adapters at run time with vLLM's request bodies and answers.
"""

from __future__ import annotations

from http import HTTPStatus

from kvpilot.engine.async_llm import AsyncLLM
from kvpilot.engine.lora.errors import LoRAAdapterError, LoRAAdapterGoneError
from kvpilot.engine.lora.request import LoRARequest
from kvpilot.engine.server.errors import OpenAIError, bad_request
from kvpilot.engine.server.protocol import (
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    UnloadLoRAAdapterRequest,
)


class OpenAIServingModels:
    """The served model names and the LoRA adapters, shared by the endpoint handlers.

    Args:
        engine: the running ``AsyncLLM``.
        served_model_names: the base model's names; the first is reported.
        max_model_len: longest prompt + output in tokens (reported per model).
        lora_requests: the adapters the engine registered at start (``--lora-modules``).
    """

    def __init__(
        self,
        engine: AsyncLLM,
        served_model_names: list[str],
        max_model_len: int,
        lora_requests: list[LoRARequest],
    ) -> None:
        self.engine = engine
        self.served_model_names = served_model_names
        self.max_model_len = max_model_len
        self.lora_requests = {r.lora_name: r for r in lora_requests}
        self._next_lora_id = max((r.lora_int_id for r in lora_requests), default=0) + 1

    def resolve(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's ``model`` names, or None for the base model.

        ``None`` or ``""`` (some clients send an empty name) is the base model, as in vLLM.

        Raises:
            OpenAIError: 404 for a name that is neither the base model nor a loaded adapter.
        """
        if not model or model in self.served_model_names:
            return None
        lora = self.lora_requests.get(model)
        if lora is None:
            raise OpenAIError(
                HTTPStatus.NOT_FOUND, f"The model `{model}` does not exist.", param="model"
            )
        return lora

    def adapter_error(self, lora: LoRARequest, exc: LoRAAdapterError) -> OpenAIError:
        """The 400 for a request whose adapter the engine could not use, naming ``model`` (the
        parameter that chose it). An adapter whose files are gone (``LoRAAdapterGoneError``)
        was unloaded by the engine: it is no longer listed, and may be loaded again."""
        if isinstance(exc, LoRAAdapterGoneError) and self.lora_requests.get(lora.lora_name) == lora:
            del self.lora_requests[lora.lora_name]
        return bad_request(exc, "model")

    def model_list(self) -> ModelList:
        """``/v1/models``: the base model's names, then the adapters with their ``parent``."""
        base = self.served_model_names[0]
        cards = [
            ModelCard(id=name, root=name, max_model_len=self.max_model_len)
            for name in self.served_model_names
        ]
        cards += [
            ModelCard(id=name, root=lora.lora_path, parent=base, max_model_len=self.max_model_len)
            for name, lora in self.lora_requests.items()
        ]
        return ModelList(data=cards)

    def model_card(self, model: str) -> ModelCard:
        """``/v1/models/{model}``: the card ``/v1/models`` lists under that id.

        Raises:
            OpenAIError: 404 for an id it does not list.
        """
        card = next((c for c in self.model_list().data if c.id == model), None)
        if card is None:
            raise OpenAIError(
                HTTPStatus.NOT_FOUND, f"The model `{model}` does not exist.", param="model"
            )
        return card

    async def load_lora_adapter(self, request: LoadLoRAAdapterRequest) -> str:
        """Load an adapter under a new name; returns vLLM's success message.

        Raises:
            OpenAIError: 400 for an empty name or path, a name already in use, LoRA not
                enabled, or an adapter the engine cannot load (the message says why).
        """
        name, path = request.lora_name, request.lora_path
        if not name or not path:
            raise bad_request("Both 'lora_name' and 'lora_path' must be provided.", "lora_name")
        if name in self.lora_requests or name in self.served_model_names:
            raise bad_request(f"The lora adapter '{name}' has already been loaded.", "lora_name")
        lora = LoRARequest(name, self._next_lora_id, path)
        try:
            await self.engine.add_lora(lora)
        except ValueError as exc:
            raise bad_request(exc, "lora_path") from None
        self._next_lora_id += 1
        self.lora_requests[name] = lora
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload_lora_adapter(self, request: UnloadLoRAAdapterRequest) -> str:
        """Unload an adapter; returns vLLM's success message.

        Raises:
            OpenAIError: 404 for an adapter that is not loaded; 400 while requests use it.
        """
        name = request.lora_name
        if name not in self.lora_requests:
            raise OpenAIError(
                HTTPStatus.NOT_FOUND,
                f"The lora adapter '{name}' cannot be found.",
                param="lora_name",
            )
        try:
            await self.engine.remove_lora(name)
        except ValueError as exc:
            raise bad_request(exc, "lora_name") from None
        del self.lora_requests[name]
        return f"Success: LoRA adapter '{name}' removed successfully."
