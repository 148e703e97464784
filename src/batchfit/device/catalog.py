"""The GPU catalog: memory, SM count and peak rates of the cards batchfit knows.

The numbers live in ``gpus.csv`` (beside this module), one row per card, each with the URL of
the vendor datasheet or whitepaper they come from. This module reads the file,
resolves the names users type (``"3090"``, ``"A100-80GB"``,
``"NVIDIA A100-SXM4-80GB"``) and, for a card that is plugged in, builds the
same record from the live device.

Conventions of the table:

- ``memory_bytes`` reads the marketed "GB" of GPU memory as GiB: an 80 GB card
  is ``80 * 2**30 = 85899345920`` bytes. CUDA reports totals close to that and a
  little below (an A100 80GB reports about 79.3 GiB; ECC and firmware keep the
  rest). H200's "141 GB" as 141 GiB is about 1 GiB above what CUDA reports.
- Peak rates are dense (no 2:4 sparsity); datasheets that print only sparse
  tensor figures were halved. ``fp32`` is the CUDA-core (AMD: vector) rate;
  ``tf32``, ``fp16``, ``bf16`` and ``fp8`` are tensor-core (AMD: matrix-core)
  rates. A rate is absent where the card lacks the format or runs it no faster
  than fp32: no ``bf16``/``tf32`` before Ampere, no ``fp8`` before Ada/Hopper,
  no ``fp16`` on Kepler and consumer Pascal (1/64 rate). P100 has no tensor
  cores; its ``fp16`` is the packed half2 rate.
- Where NVIDIA lists two fp16 tensor figures for a GeForce card (fp16 and fp32
  accumulate), the table holds the fp32-accumulate one, which is what PyTorch
  uses and half the other. The same holds for GeForce ``bf16`` and ``fp8``.
  GeForce figures are at reference (not Founders Edition) boost clocks. Workstation
  cards (RTX A/Ada/PRO) accumulate in fp32 at the full rate; where NVIDIA prints only
  "AI TOPS" (FP4 with sparsity) the tensor rates are divided down from it.
- Where CUDA reports much less than the marketed figure (B300: 288 GB marketed,
  268.6 GiB reported), the row holds what CUDA reports, rounded down to whole GiB.
- ``cuda_total_mib`` is what CUDA reports as the card's total where a public report gives
  it (``cuda_total_source``: the URL, then `` | `` and the figure as the report prints it):
  torch's "total capacity" in its out-of-memory
  message, which is ``cudaMemGetInfo``'s total (``torch.cuda.mem_get_info()[1]``, and
  ``get_device_properties().total_memory``). The driver keeps the rest of the marketed
  memory for itself (``nvidia-smi -q`` shows it as "Reserved" on recent drivers, and
  counts it in its "Total"): an RTX 3090 reports 23.70 GiB of 24. The figure is torch's
  two-decimal GiB times 1024, rounded down to whole MiB. It moves a little with the driver
  (3090 reports range from 23.70 down to 23.57 GiB; an A100 40GB PCIe from 40,326 to 40,441
  MiB, the largest under the newest driver); a row holds
  the largest figure its reports show, so no driver keeps less than the row assumes. A
  report in bytes (deviceQuery's ``totalGlobalMem``, XLA's captured ``device_memory_size``)
  is exact; torch's ``total_memory=...MB`` and nvbench's "MiB Total" are whole MiB rounded
  down; a two-decimal GiB is +-5 MiB. ROCm reports ``hipMemGetInfo``'s total the same way,
  and ``rocminfo`` prints it in KiB as the GPU agent's global pool size (an MI300X's pool of
  201,310,208 KB is the 196,592 MiB torch prints on one), exact to the KiB.
  GDDR6 datacenter cards (T4, A10, L4, A40, L40S) hold their ECC-on figure, as they ship:
  ECC keeps 1/16 of the memory for check bits; workstation cards hold the ECC-off figure
  their reports show. A row without one (no public report found) uses ``memory_bytes``, as
  before; ``serve`` says so in its notes.
- Boards with two dies that PyTorch shows as two devices (Tesla K80, AMD
  MI250/MI250X) have one row per device, with that device's share.
- AMD rows give compute units in ``sm_count``, the gfx architecture in
  ``arch`` and no compute capability.
- The ``notes`` column says how a row departs from its source, if at all, and where a
  figure comes from when the vendor publishes none (China-market cards).
- ``unified_memory`` is ``yes`` for a GPU that shares its memory with the CPU (Jetson):
  its ``memory_bytes`` is the module's whole memory, of which the OS and every CPU
  process take a share, so an answer for it assumes all of it is free for CUDA.

Name resolution: case, spaces, dashes and underscores do not matter, and the
vendor words "nvidia", "geforce", "tesla", "quadro", "amd" and "instinct" are
optional. "GB", "GiB" and "G" after a number are the same. Every name, key and
alias of a card resolves to it, and so does each of them followed by the card's
memory ("RTX 3090 24GB", "a100-80g"). A name that fits several memory or
form-factor variants resolves to the most common one in clouds today: "A100"
is the 80GB SXM card, "H100" the SXM card, "V100" the 16GB SXM2 card, "RTX PRO
6000" the Server Edition (the one clouds rent; all three have 96 GB). Where two
variants are equally common ("RTX 4060 Ti" with 8 or 16 GB) the bare name is
not an alias, and the error names the variant the catalog has. For a card the
catalog lacks in some memory size, its architecture with that memory is
``find_gpu(name).with_memory(n_bytes)`` (``--gpu NAME --memory SIZE``).

Example:
    >>> from batchfit.device.catalog import find_gpu
    >>> gpu = find_gpu("rtx3090")
    >>> gpu.name, gpu.memory_bytes // 2**30, gpu.peak_flops["bf16"] / 1e12
    ('NVIDIA GeForce RTX 3090', 24, 71.0)
"""

from __future__ import annotations

import csv
import difflib
import functools
import io
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from importlib import resources
from types import MappingProxyType
from typing import Any

from batchfit.errors import InvalidInputError, option

#: The precisions a card can list a peak rate for, as in the CSV's ``*_tflops`` columns.
PRECISIONS = ("fp32", "tf32", "fp16", "bf16", "fp8")

_VENDOR_WORDS = ("nvidia", "geforce", "tesla", "quadro", "amd", "instinct")
_GIB = 2**30
#: ``cuda_total_source`` of a card whose memory is the whole that CUDA hands out: given by
#: the user (:meth:`GPU.with_memory`) or read from the device (:func:`live_gpu`).
GIVEN = "given"


@dataclass(frozen=True)
class GPU:
    """One GPU model (or one live device) and the numbers batchfit needs about it.

    Attributes:
        name: canonical name, e.g. "NVIDIA A100 80GB SXM"; for a live device, the
            name the driver reports.
        key: short slug, e.g. "a100-80gb"; "cuda:0" for a live device.
        vendor: "nvidia" or "amd".
        memory_bytes: device memory (marketed GB read as GiB; live: as reported).
        sm_count: streaming multiprocessors (AMD: compute units).
        compute_capability: CUDA compute capability, e.g. (8, 0); None on AMD.
        arch: AMD gfx architecture, e.g. "gfx90a"; None on NVIDIA.
        peak_flops: dense peak FLOP/s by precision ("fp32", "tf32", "fp16",
            "bf16", "fp8"), only for the precisions the card accelerates.
        memory_bandwidth_bytes_per_s: peak memory bandwidth.
        aliases: other names that resolve to this card.
        source: where the numbers come from (a datasheet URL).
        unified_memory: the GPU shares its memory with the CPU (Jetson): the OS and
            every CPU process, the training process's own host memory included, take
            from ``memory_bytes`` too.
        cuda_total_bytes: what CUDA reports as the card's total (``cudaMemGetInfo``,
            torch's "total capacity"), from ``cuda_total_source``; None where no public
            report gives it (then ``memory_bytes`` stands for it).
        cuda_total_source: the URL of the report ``cuda_total_bytes`` comes from, then
            `` | `` and the figure as it prints it.
    """

    name: str
    key: str
    vendor: str
    memory_bytes: int
    sm_count: int
    compute_capability: tuple[int, int] | None
    arch: str | None
    peak_flops: Mapping[str, float] = field(hash=False)
    memory_bandwidth_bytes_per_s: float
    aliases: tuple[str, ...]
    source: str
    unified_memory: bool = False
    cuda_total_bytes: int | None = None
    cuda_total_source: str = ""

    @property
    def usable_memory_bytes(self) -> int:
        """The memory a process can allocate from, context included: what CUDA reports as
        the total where the catalog has it, else ``memory_bytes``.

        Example:
            >>> from batchfit.device.catalog import find_gpu
            >>> find_gpu("RTX 3090").usable_memory_bytes // 2**20  # 23.70 GiB of 24
            24268
        """
        return self.cuda_total_bytes if self.cuda_total_bytes is not None else self.memory_bytes

    def with_memory(self, memory_bytes: int) -> GPU:
        """This card's architecture (compute capability, SMs, rates, bandwidth) with other
        memory: a memory variant the catalog lacks, or the share of a card you may use.

        Example:
            >>> from batchfit.device.catalog import find_gpu
            >>> gpu = find_gpu("RTX 5090").with_memory(48 * 2**30)
            >>> gpu.memory_bytes // 2**30, gpu.compute_capability, gpu.sm_count
            (48, (12, 0), 170)
        """
        if (isinstance(memory_bytes, bool) or not isinstance(memory_bytes, (int, float))
                or memory_bytes <= 0 or memory_bytes != int(memory_bytes)):
            raise InvalidInputError(
                f"memory_bytes must be a positive number of bytes, not {memory_bytes!r}")
        # The given memory is the whole: what CUDA would report for it.
        return replace(self, memory_bytes=int(memory_bytes), cuda_total_bytes=None,
                       cuda_total_source=GIVEN)

    @property
    def memory_is_marketed(self) -> bool:
        """No report of what CUDA reports as this card's total is known, and none was
        given (:meth:`with_memory`) or read from the device (:func:`live_gpu`), so the
        marketed memory stands in for it: CUDA reports a little less, so an answer at the
        edge of the card may not fit.

        Example:
            >>> from batchfit.device.catalog import find_gpu
            >>> find_gpu("H800").memory_is_marketed, find_gpu("H100 SXM").memory_is_marketed
            (True, False)
            >>> find_gpu("H800").with_memory(79 * 2**30).memory_is_marketed
            False
        """
        return self.cuda_total_bytes is None and self.cuda_total_source != GIVEN

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        """Pickle (a trace worker sends estimates back): the read-only rates as a dict."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values["peak_flops"] = dict(self.peak_flops)
        return _gpu_from_fields, (values,)

    def to_dict(self) -> dict[str, Any]:
        """The card as plain JSON-ready data (compute capability as "8.0")."""
        cc = self.compute_capability
        return {
            "name": self.name,
            "key": self.key,
            "vendor": self.vendor,
            "memory_bytes": self.memory_bytes,
            "sm_count": self.sm_count,
            "compute_capability": None if cc is None else f"{cc[0]}.{cc[1]}",
            "arch": self.arch,
            "peak_flops": dict(self.peak_flops),
            "memory_bandwidth_bytes_per_s": self.memory_bandwidth_bytes_per_s,
            "aliases": list(self.aliases),
            "source": self.source,
            "unified_memory": self.unified_memory,
            "cuda_total_bytes": self.cuda_total_bytes,
            "cuda_total_source": self.cuda_total_source,
        }


def _gpu_from_fields(values: dict[str, Any]) -> GPU:
    return GPU(**{**values, "peak_flops": MappingProxyType(values["peak_flops"])})


@functools.cache
def load_catalog() -> tuple[GPU, ...]:
    """Every card in ``gpus.csv`` (beside this module), in file order (read once, then cached).

    Example:
        >>> from batchfit.device.catalog import load_catalog
        >>> len(load_catalog()) >= 30
        True
    """
    text = resources.files("batchfit.device").joinpath("gpus.csv").read_text(encoding="utf-8")
    gpus = []
    # start=2: line 1 is the header, so error messages point at the real line.
    for line, row in enumerate(csv.DictReader(io.StringIO(text)), start=2):
        try:
            gpus.append(_parse_row(row))
        except (KeyError, ValueError) as exc:
            raise ValueError(f"gpus.csv line {line}: {exc!r}") from exc
    return tuple(gpus)


def list_gpus() -> tuple[GPU, ...]:
    """The catalog for display: by vendor, then memory, then name.

    Example:
        >>> from batchfit.device.catalog import list_gpus
        >>> list_gpus()[0].vendor
        'amd'
    """
    return tuple(sorted(load_catalog(), key=lambda g: (g.vendor, g.memory_bytes, g.name)))


def find_gpu(name: str) -> GPU:
    """Resolve what a user typed, or what the driver reports, to a catalog card.

    See the module docstring for the rules.

    Raises:
        InvalidInputError: no card matches; the message suggests the closest name.

    Example:
        >>> from batchfit.device.catalog import find_gpu
        >>> find_gpu("NVIDIA A100-SXM4-80GB").key, find_gpu("v100 32gb").key
        ('a100-80gb', 'v100-32gb')
    """
    norm = _normalise(name)
    if not norm:
        raise InvalidInputError(
            f"empty GPU name {name!r}: pass a card such as 'A100' (batchfit gpus lists all)")
    cards, _ = _index()
    if norm in cards:
        return cards[norm]
    raise InvalidInputError(_unknown_message(name, norm))


#: Words that tell variants of one card apart (form factor, memory, generation), as opposed
#: to words that name another card ("Ti", "S", "X": an RTX 3080 Ti is not an RTX 3080).
_VARIANT_WORDS = frozenset({"g", "gb", "gib", "sxm", "pcie", "nvl", "hbm", "server",
                            "workstation", "edition", "max", "q", "ada", "generation",
                            "blackwell"})


@dataclass(frozen=True)
class GpuChoice:
    """The card a name resolved to, and the other variants the same name could mean.

    Attributes:
        requested: the name as given.
        card: the card it resolved to (:func:`find_gpu`).
        alternatives: other catalog cards whose names extend the given one with variant
            words only (memory, form factor: "A100" -> "A100 40GB", "A100 PCIe"); empty
            when the name picks one card.
    """

    requested: str
    card: GPU
    alternatives: tuple[GPU, ...] = ()

    @property
    def ambiguous(self) -> bool:
        return bool(self.alternatives)

    def to_dict(self) -> dict[str, Any]:
        return {"requested": self.requested, "name": self.card.name, "key": self.card.key,
                "alternatives": [g.name for g in self.alternatives]}


def choose_gpu(name: str) -> GpuChoice:
    """:func:`find_gpu`, and the variants the name leaves open (the catalog picks the most
    common one; a caller says which it took).

    Raises:
        InvalidInputError: as :func:`find_gpu`.

    Example:
        >>> from batchfit.device.catalog import choose_gpu
        >>> choice = choose_gpu("V100")
        >>> choice.card.key, [g.key for g in choice.alternatives]
        ('v100-16gb', ['v100-32gb', 'v100-pcie-16gb', 'v100-pcie-32gb'])
        >>> choose_gpu("RTX 3080").ambiguous
        False
    """
    card = find_gpu(name)
    typed = _tokens(name)
    alternatives = tuple(
        other for other in load_catalog() if other is not card and any(
            (names := _tokens(text))[:len(typed)] == typed and len(names) > len(typed)
            and all(t.isdigit() or t in _VARIANT_WORDS for t in names[len(typed):])
            for text in (other.name, other.key, *other.aliases)))
    return GpuChoice(requested=name, card=card, alternatives=alternatives)


def _tokens(text: str) -> list[str]:
    """A name as words and numbers without the vendor words: "A100-SXM4-80GB" ->
    ["a", "100", "sxm", "4", "80", "gb"]."""
    return [t for t in re.findall(r"[a-z]+|\d+", str(text).lower()) if t not in _VENDOR_WORDS]


def live_gpu(index: int = 0) -> GPU:
    """Describe CUDA device ``cuda:{index}`` as the driver reports it.

    Memory, SM count and compute capability come from the device; with
    nvidia-ml-py installed, memory other processes hold on it (NVML) is taken off
    ``memory_bytes`` and named in ``source``. An integrated GPU (Jetson), whose memory is
    the system's, gets what the kernel reports available (``MemAvailable``) instead, and
    ``unified_memory`` set. Peak rates
    and bandwidth come from the catalog card the device name resolves to; if
    the name is unknown, from the card with the same compute capability (or gfx
    arch) and SM count. A partition (MIG slice, AMD CPX) gets the card's rates
    scaled by its share of SMs and memory. Imports torch.

    Raises:
        InvalidInputError: CUDA is unavailable or there is no such device; or
            the device is not in the catalog and torch is too old to report its
            memory clock (new cards need a new torch, so this is rare).

    Example:
        >>> from batchfit.device.catalog import live_gpu
        >>> live_gpu(0).memory_bytes > 0  # doctest: +SKIP
        True
    """
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not 0 <= index < count:
        devices = "device" if count == 1 else "devices"
        raise InvalidInputError(
            f"no CUDA device cuda:{index}: this machine has {count} CUDA {devices}; "
            f"use {option('gpu', 'NAME')} to predict for a card you don't have")
    props = torch.cuda.get_device_properties(index)
    is_rocm = torch.version.hip is not None
    arch = props.gcnArchName.split(":")[0] if is_rocm else None
    cc = None if is_rocm else (props.major, props.minor)
    memory_bytes = int(props.total_memory)
    sm_count = int(props.multi_processor_count)
    card = _match_device(props.name, cc, arch, sm_count, memory_bytes)
    source = f"torch.cuda.get_device_properties(cuda:{index})"
    if card is None:
        peak_flops: Mapping[str, float] = MappingProxyType({})
        bandwidth = _bandwidth_from_props(props, index)
    else:
        # A partition (fewer SMs than the card) gets its share of compute and of
        # memory bandwidth, which MIG hands out with the memory slices.
        is_partition = sm_count < card.sm_count
        sm_share = sm_count / card.sm_count if is_partition else 1.0
        memory_share = min(1.0, memory_bytes / card.memory_bytes) if is_partition else 1.0
        peak_flops = MappingProxyType({k: v * sm_share for k, v in card.peak_flops.items()})
        bandwidth = card.memory_bandwidth_bytes_per_s * memory_share
        source += f"; peak rates of catalog card {card.key!r} ({card.source})"
    # An integrated GPU (Jetson) allocates from the same DRAM as the CPU (NVIDIA, "CUDA for
    # Tegra": device, host and unified memory are the same physical SoC DRAM), and
    # total_memory is all of it; what a new allocation can get is what the kernel counts as
    # MemAvailable. NVML reports nothing there, so the two paths do not overlap.
    unified = bool(getattr(props, "is_integrated", False))
    available = host_memory_available_bytes() if unified else None
    if available is not None and available < memory_bytes:
        memory_bytes = available
        source += "; unified memory: MemAvailable of /proc/meminfo (shared with the CPU and OS)"
    others = None if unified else memory_used_by_others(props)
    if others:
        memory_bytes -= others
        source += f"; less {others} B other processes hold (NVML)"
    return GPU(
        name=props.name, key=f"cuda:{index}", vendor="amd" if is_rocm else "nvidia",
        memory_bytes=memory_bytes, sm_count=sm_count, compute_capability=cc, arch=arch,
        peak_flops=peak_flops, memory_bandwidth_bytes_per_s=bandwidth, aliases=(),
        source=source, unified_memory=unified, cuda_total_source=GIVEN)


def host_memory_available_bytes(meminfo: str = "/proc/meminfo") -> int | None:
    """The kernel's estimate of memory available to new allocations without swapping
    (``MemAvailable``, Documentation/filesystems/proc.rst), or None where there is none."""
    try:
        with open(meminfo, encoding="ascii") as lines:
            for line in lines:
                if line.startswith("MemAvailable:"):
                    value, unit = line.split()[1:3]
                    return int(value) * 1024 if unit == "kB" else None
    except (OSError, ValueError):
        return None
    return None


def memory_used_by_others(props: Any) -> int | None:
    """Bytes other processes hold on the device ``props`` describes, from NVML
    (nvidia-ml-py), or None when NVML is not installed or cannot tell. The device is
    found by PCI bus id, so ``CUDA_VISIBLE_DEVICES`` renumbering does not matter."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no driver library: nothing to subtract
        return None
    try:
        bus_id = f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
        handle = pynvml.nvmlDeviceGetHandleByPciBusId(bus_id)
        processes = (list(pynvml.nvmlDeviceGetComputeRunningProcesses(handle))
                     + list(pynvml.nvmlDeviceGetGraphicsRunningProcesses(handle)))
        own = os.getpid()
        return sum(p.usedGpuMemory or 0 for p in processes if p.pid != own)
    except Exception:  # noqa: BLE001 - NVML errors, or torch too old for PCI ids
        return None
    finally:
        pynvml.nvmlShutdown()


def _parse_row(row: Mapping[str, str]) -> GPU:
    cc: tuple[int, int] | None = None
    if cc_text := row["compute_capability"].strip():
        major, minor = cc_text.split(".")  # ValueError unless MAJOR.MINOR
        cc = (int(major), int(minor))
    peak_flops = {p: float(row[f"{p}_tflops"]) * 1e12
                  for p in PRECISIONS if row[f"{p}_tflops"].strip()}
    return GPU(
        name=row["name"].strip(),
        key=row["key"].strip(),
        vendor=row["vendor"].strip(),
        memory_bytes=int(row["memory_bytes"]),
        sm_count=int(row["sm_count"]),
        compute_capability=cc,
        arch=row["arch"].strip() or None,
        peak_flops=MappingProxyType(peak_flops),
        memory_bandwidth_bytes_per_s=float(row["memory_bandwidth_gbs"]) * 1e9,
        aliases=tuple(a.strip() for a in row["aliases"].split("|") if a.strip()),
        source=row["source"].strip(),
        unified_memory=_parse_flag(row["unified_memory"]),
        **_parse_cuda_total(row),
    )


def _parse_cuda_total(row: Mapping[str, str]) -> dict[str, Any]:
    mib, source = row["cuda_total_mib"].strip(), row["cuda_total_source"].strip()
    if bool(mib) != bool(source):
        raise ValueError("cuda_total_mib and cuda_total_source go together")
    if not mib:
        return {}
    total = int(mib) * 2**20
    if not 0 < total <= int(row["memory_bytes"]):
        raise ValueError(f"cuda_total_mib {mib} must be positive and at most memory_bytes")
    return {"cuda_total_bytes": total, "cuda_total_source": source}


def _parse_flag(text: str) -> bool:
    value = text.strip().lower()
    if value not in ("", "yes"):
        raise ValueError(f"a flag column holds 'yes' or nothing, not {text!r}")
    return value == "yes"


def _normalise(text: str) -> str:
    """Fold a name to the form names are compared in: "NVIDIA A100-SXM4-80GB" -> "a100sxm480g"."""
    tokens = [t for t in re.findall(r"[a-z0-9]+", str(text).lower()) if t not in _VENDOR_WORDS]
    folded = "".join(tokens)
    # Vendor words glued to the model ("geforcertx3090") survive tokenising.
    while prefix := next((w for w in _VENDOR_WORDS if folded.startswith(w)), None):
        folded = folded[len(prefix):]
    return re.sub(r"(?<=\d)gi?b", "g", folded)


@functools.cache
def _index() -> tuple[dict[str, GPU], dict[str, str]]:
    """Normalised name -> card, and normalised name -> its shortest spelling (for suggestions).

    Two cards claiming one name is a bug in gpus.csv and raises ValueError.
    """
    cards: dict[str, GPU] = {}
    spelling: dict[str, str] = {}
    for gpu in load_catalog():
        for text in (gpu.name, gpu.key, *gpu.aliases):
            norm = _normalise(text)
            owner = cards.setdefault(norm, gpu)
            if owner is not gpu:
                raise ValueError(f"gpus.csv: {text!r} names both {owner.key!r} and {gpu.key!r}")
        # Suggestions quote names and aliases ("RTX 3090"), not slugs ("rtx-3090").
        for text in (gpu.name, *gpu.aliases):
            norm = _normalise(text)
            if norm not in spelling or len(text) < len(spelling[norm]):
                spelling[norm] = text
    # Any name followed by the card's own memory: "RTX 3090 24GB". Explicit names win.
    for gpu in load_catalog():
        if gpu.memory_bytes % _GIB == 0:
            suffix = f"{gpu.memory_bytes // _GIB}g"
            for text in (gpu.name, gpu.key, *gpu.aliases):
                cards.setdefault(_normalise(text) + suffix, gpu)
    return cards, spelling


def _unknown_message(name: str, norm: str) -> str:
    cards, spelling = _index()
    # A variant's name extends the bare one ("RTX 5060 Ti" -> "RTX 5060 Ti 16GB"): when one
    # card's names do, it is the variant the catalog has, closer than any edit distance says
    # ("RTX 5070 Ti" differs from "RTX 5060 Ti" by one character).
    extending = [n for n in spelling if n.startswith(norm)]
    if extending and len({cards[n].key for n in extending}) == 1:
        close = [min(extending, key=lambda n: len(spelling[n]))]
    else:
        close = difflib.get_close_matches(norm, spelling, n=1, cutoff=0.6)
    hint = f": did you mean {spelling[close[0]]!r}?" if close else ""
    return f"unknown GPU {name!r}{hint} (batchfit gpus lists all)"


def _match_device(name: str, compute_capability: tuple[int, int] | None, arch: str | None,
                  sm_count: int, memory_bytes: int) -> GPU | None:
    """The catalog card a live device is, or is a partition of; None if unknown."""
    # A MIG slice reports its parent's name and profile: "NVIDIA A100-SXM4-80GB MIG 1g.10gb".
    try:
        named: GPU | None = find_gpu(re.split(r"\s+MIG\s", name)[0])
    except InvalidInputError:
        named = None
    if named is not None and named.sm_count == sm_count:
        return named
    # Drivers sometimes report a generic name ("AMD Radeon Graphics", "NVIDIA
    # Graphics Device"); architecture and SM count still pin the card down.
    alike = [g for g in load_catalog() if g.sm_count == sm_count
             and g.compute_capability == compute_capability and g.arch == arch]
    if alike:
        return min(alike, key=lambda g: abs(g.memory_bytes - memory_bytes))
    return named


def _bandwidth_from_props(props: Any, index: int) -> float:
    """Theoretical bandwidth from the memory clock (kHz) and bus width (bits) torch reports."""
    clock_khz = getattr(props, "memory_clock_rate", 0)
    bus_bits = getattr(props, "memory_bus_width", 0)
    if not clock_khz or not bus_bits:
        raise InvalidInputError(
            f"cuda:{index} ({props.name!r}) is not in the GPU catalog and this torch does not "
            f"report its memory bus; use {option('gpu', 'NAME')} with the closest card "
            "(batchfit gpus lists all)")
    # Double data rate: two transfers per clock, as in CUDA's bandwidthTest.
    return 2.0 * clock_khz * 1e3 * bus_bits / 8
