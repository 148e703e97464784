"""How fast GPUs talk: GPU-to-GPU bandwidth inside a node, and between nodes.

Inside a node the table (``interconnect.csv``, one row per catalog GPU, with its source)
gives the bandwidth one GPU has to its peers, each way: NVLink for the SXM parts (half
of NVIDIA's bidirectional figure), PCIe for the others. A card missing from the table
talks over PCIe: Gen4 x16 (16 GT/s x 16 lanes, 128b/130b: 31.5 GB/s each way) for cards
from Ampere on (compute capability 8), Gen3 (15.75 GB/s) before. Between nodes a GPU
has its own network link: 400 Gb/s (50 GB/s each way: one InfiniBand NDR port per GPU,
as in NVIDIA's DGX H100 and B200), a default to override for other clusters.

Example:
    >>> from batchfit.device.catalog import find_gpu
    >>> link_for(find_gpu("H100 SXM")).gpu_to_gpu_bytes_per_s / 1e9
    450.0
    >>> link_for(find_gpu("RTX 4090")).name
    'PCIe Gen4 x16'
"""

from __future__ import annotations

import csv
import functools
from dataclasses import dataclass
from importlib import resources
from typing import Any

GB = 1e9
#: Between nodes, per GPU and each way: 400 Gb/s (InfiniBand NDR, one port per GPU).
DEFAULT_NETWORK_BYTES_PER_S = 50 * GB
_PCIE_GEN4 = 31.5 * GB
_PCIE_GEN3 = 15.75 * GB


@dataclass(frozen=True)
class Link:
    """A GPU's link to its peers in the same node.

    Attributes:
        name: ``NVLink 4``, ``PCIe Gen4 x16``...
        gpu_to_gpu_bytes_per_s: bandwidth each way.
        source: where the figure comes from.
    """

    name: str
    gpu_to_gpu_bytes_per_s: float
    source: str


@functools.cache
def _table() -> dict[str, Link]:
    text = resources.files("batchfit.device").joinpath("interconnect.csv").read_text()
    return {row["key"]: Link(row["link"], float(row["gpu_to_gpu_gbs"]) * GB, row["source"])
            for row in csv.DictReader(text.splitlines())}


def link_for(gpu: Any) -> Link:
    """The intra-node link of a catalog :class:`~batchfit.device.catalog.GPU`."""
    found = _table().get(getattr(gpu, "key", ""))
    if found is not None:
        return found
    capability = getattr(gpu, "compute_capability", None) or (0, 0)
    if capability >= (8, 0):
        return Link("PCIe Gen4 x16", _PCIE_GEN4, "PCI-SIG: 16 GT/s x 16 lanes, 128b/130b")
    return Link("PCIe Gen3 x16", _PCIE_GEN3, "PCI-SIG: 8 GT/s x 16 lanes, 128b/130b")
