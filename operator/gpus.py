"""The GPU catalogue: device memory and default GPUs per node of each ``spec.gpu.type``.

Memory is the total the NVIDIA driver reports (``nvidia-smi --query-gpu=memory.total``, MiB),
not the marketing size: an "80 GB" H100 holds 81,559 MiB and vLLM's
``gpu_memory_utilization`` is a fraction of that total. ``perNode`` is the largest common
node shape (8 GPUs for the cloud instances that carry each type: AWS g6/g5/g6e.48xlarge,
p4d/p4de/p5/p5e/p6, GCP a2/a3/g2), overridden by ``spec.gpu.perNode``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

MiB = 1024**2
GiB = 1024**3

CUSTOM = "custom"
"""``spec.gpu.type`` for a GPU outside the catalogue; ``spec.gpu.memoryGiB`` gives its memory."""

CPU = "cpu"
"""The ``gpuType`` of a plan without a GPU (``spec.gpu`` absent: CPU development mode)."""

DEFAULT_RESOURCE_NAME = "nvidia.com/gpu"
"""The extended resource the NVIDIA device plugin advertises."""

PRODUCT_LABEL = "nvidia.com/gpu.product"
"""The node label GPU Feature Discovery (NVIDIA's GPU operator) sets to the GPU's product name,
the NVML name with spaces as dashes (``NVIDIA-H100-80GB-HBM3``)."""


@dataclass(frozen=True)
class GpuType:
    """One accelerator model.

    Attributes:
        name: catalogue key, as written in ``spec.gpu.type`` (e.g. ``"H100-80GB"``).
        memory_bytes: total device memory, bytes.
        per_node: GPUs per node, the upper bound of ``tensor_parallel_size``.
        nvlink: whether the GPUs of one node talk over NVLink (tensor parallelism over PCIe
            works but its all-reduces are slower).
        products: the ``PRODUCT_LABEL`` values of nodes with this GPU (its SXM and PCIe
            variants of the same memory); engine pods are scheduled only onto those.
    """

    name: str
    memory_bytes: int
    per_node: int = 8
    nvlink: bool = False
    products: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.memory_bytes < 1:
            raise ValueError(f"GPU {self.name!r}: memory_bytes must be positive")
        if self.per_node < 1:
            raise ValueError(f"GPU {self.name!r}: per_node must be at least 1")


CATALOGUE: dict[str, GpuType] = {
    gpu.name: gpu
    for gpu in (
        GpuType("L4", 23_034 * MiB, products=("NVIDIA-L4",)),
        GpuType("A10G", 23_028 * MiB, products=("NVIDIA-A10G",)),
        GpuType("L40S", 46_068 * MiB, products=("NVIDIA-L40S",)),
        GpuType(
            "A100-40GB",
            40_960 * MiB,
            nvlink=True,
            products=("NVIDIA-A100-SXM4-40GB", "NVIDIA-A100-PCIE-40GB"),
        ),
        GpuType(
            "A100-80GB",
            81_920 * MiB,
            nvlink=True,
            products=("NVIDIA-A100-SXM4-80GB", "NVIDIA-A100-80GB-PCIe"),
        ),
        GpuType(
            "H100-80GB",
            81_559 * MiB,
            nvlink=True,
            products=("NVIDIA-H100-80GB-HBM3", "NVIDIA-H100-PCIe"),
        ),
        GpuType(
            "H200-141GB", 143_771 * MiB, nvlink=True, products=("NVIDIA-H200", "NVIDIA-H200-NVL")
        ),
        GpuType("B200", 183_359 * MiB, nvlink=True, products=("NVIDIA-B200",)),
    )
}
"""Every named GPU type ``spec.gpu.type`` accepts besides ``custom``."""


def gpu_type(name: str, *, memory_gib: float | None = None, per_node: int | None = None) -> GpuType:
    """Look up a catalogue GPU, or describe a ``custom`` one, optionally overriding ``per_node``.

    Args:
        name: a ``CATALOGUE`` key or ``"custom"``.
        memory_gib: device memory in GiB; required for ``custom``, refused otherwise (the
            catalogue already knows it).
        per_node: GPUs per node; default the catalogue's (8), or 1 for ``custom``.

    Raises:
        ValueError: unknown name (listing the known ones), ``custom`` without ``memory_gib``,
            ``memory_gib`` on a catalogue type, or a non-positive size.
    """
    if name == CUSTOM:
        if memory_gib is None:
            raise ValueError("gpu type 'custom' needs memoryGiB")
        if memory_gib <= 0:
            raise ValueError(f"gpu memoryGiB must be positive, got {memory_gib!r}")
        return GpuType(CUSTOM, int(memory_gib * GiB), per_node or 1)
    if name not in CATALOGUE:
        raise ValueError(_unknown(name, [*CATALOGUE, CUSTOM]))
    if memory_gib is not None:
        raise ValueError(f"gpu memoryGiB is only for type 'custom', not {name!r}")
    known = CATALOGUE[name]
    if per_node is None:
        return known
    return GpuType(known.name, known.memory_bytes, per_node, known.nvlink, known.products)


def resolve_gpu_name(name: str, names: Iterable[str] = (*CATALOGUE, CUSTOM)) -> str:
    """The canonical spelling of a GPU type a person typed, for the command line.

    Case does not matter (``h100-80gb``), and a name's first ``-``-separated part stands for
    it when no other name shares that part (``H100`` -> ``H100-80GB``; ``A100`` is ambiguous
    between ``A100-40GB`` and ``A100-80GB``). An alias never cuts a part short: ``L40`` and
    ``A10`` are other GPUs than ``L40S`` and ``A10G``, so they are unknown, not matched.

    The CRD's ``spec.gpu.type`` is an enum and stays exact (one canonical spelling per object):
    ``operator/spec.py`` does not call this.

    Args:
        name: what was typed.
        names: the canonical names to choose from (default: the catalogue and ``custom``).

    Raises:
        ValueError: unknown (listing every name) or ambiguous (listing the candidates).
    """
    names = list(names)
    folded = name.casefold()
    exact = [known for known in names if known.casefold() == folded]
    if exact:
        return exact[0]
    matches = [known for known in names if known.casefold().startswith(f"{folded}-")]
    if len(matches) == 1:
        return matches[0]
    if matches:
        raise ValueError(f"gpu type {name!r} is ambiguous: {' or '.join(matches)}")
    raise ValueError(_unknown(name, names))


def _unknown(name: str, names: list[str]) -> str:
    return f"unknown gpu type {name!r}; known: {', '.join(names)}"
