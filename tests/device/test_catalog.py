"""The GPU catalog: its data, name resolution and the live-device path.

Expected numbers are written out by hand from the vendors' datasheets, not read
back from gpus.csv.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import urlparse

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchfit.device.catalog import GPU, find_gpu, list_gpus, live_gpu, load_catalog
from batchfit.errors import InvalidInputError

GIB = 1024**3

# Every card the catalog must have, with spellings users and drivers produce.
REQUIRED = {
    "titan-x-pascal": ["Titan X Pascal", "TITAN X (Pascal)", "NVIDIA TITAN X (Pascal)"],
    "gtx-1080-ti": ["1080 Ti", "GTX 1080 Ti", "GeForce GTX 1080 Ti", "NVIDIA GeForce GTX 1080 Ti"],
    "rtx-2080-ti": ["2080 Ti", "RTX 2080 Ti", "rtx-2080-ti", "NVIDIA GeForce RTX 2080 Ti"],
    "t4": ["T4", "Tesla T4", "NVIDIA T4", "t4 16gb"],
    "v100-16gb": ["V100", "V100 16GB", "v100-16gb", "Tesla V100-SXM2-16GB"],
    "v100-32gb": ["V100 32GB", "v100_32gb", "Tesla V100-SXM2-32GB"],
    "v100-pcie-16gb": ["V100 PCIe", "Tesla V100-PCIE-16GB"],
    "a10": ["A10", "NVIDIA A10", "a10 24gb"],
    "a100-40gb": ["A100 40GB", "A100-40GB", "a100 40g", "NVIDIA A100-SXM4-40GB"],
    "a100-80gb": ["A100", "A100-80GB", "A100 80G", "a100 80 gb", "NVIDIA A100-SXM4-80GB"],
    "a100-pcie-80gb": ["A100 PCIe", "A100 80GB PCIe", "NVIDIA A100 80GB PCIe"],
    "l4": ["L4", "NVIDIA L4"],
    "l40s": ["L40S", "NVIDIA L40S", "l40s 48gb"],
    "rtx-3090": ["3090", "RTX 3090", "rtx3090", "GeForce RTX 3090", "NVIDIA GeForce RTX 3090"],
    "rtx-4090": ["4090", "RTX 4090", "rtx_4090", "NVIDIA GeForce RTX 4090"],
    "rtx-5090": ["5090", "RTX 5090", "NVIDIA GeForce RTX 5090"],
    "rtx-a6000": ["A6000", "RTX A6000", "NVIDIA RTX A6000"],
    "h100-pcie": ["H100 PCIe", "NVIDIA H100 PCIe", "h100-pcie-80gb"],
    "h100-sxm": ["H100", "H100 SXM", "H100 80GB", "NVIDIA H100 80GB HBM3"],
    "h200": ["H200", "NVIDIA H200", "h200 141gb"],
    "b200": ["B200", "NVIDIA B200"],
    "mi250x": ["MI250X", "AMD Instinct MI250X", "instinct mi250x"],
    "mi300x": ["MI300X", "AMD Instinct MI300X", "amd mi300x"],
}


def _every_name(gpu: GPU) -> list[str]:
    return [gpu.name, gpu.key, *gpu.aliases]


# --- the data -----------------------------------------------------------------


def test_catalog_has_at_least_30_cards_with_unique_keys():
    keys = [gpu.key for gpu in load_catalog()]
    assert len(keys) >= 30
    assert len(set(keys)) == len(keys)


@pytest.mark.parametrize("gpu", load_catalog(), ids=lambda g: g.key)
def test_every_row_is_complete(gpu):
    assert gpu.memory_bytes > 0
    assert gpu.sm_count > 0
    assert gpu.memory_bandwidth_bytes_per_s > 0
    assert gpu.vendor in {"nvidia", "amd"}
    # Exactly one of the two architecture fields, by vendor.
    assert (gpu.compute_capability is None) == (gpu.vendor == "amd")
    assert (gpu.arch is None) == (gpu.vendor == "nvidia")
    url = urlparse(gpu.source)
    assert url.scheme == "https"
    assert url.hostname is not None and url.hostname.endswith(("nvidia.com", "amd.com"))
    assert "fp32" in gpu.peak_flops
    assert set(gpu.peak_flops) <= {"fp32", "tf32", "fp16", "bf16", "fp8"}


@pytest.mark.parametrize("gpu", load_catalog(), ids=lambda g: g.key)
def test_rates_are_consistent_with_each_other(gpu):
    # Catches a misplaced decimal point or a sparse figure left undivided.
    rates = gpu.peak_flops
    assert 1e12 < rates["fp32"] < 200e12
    for precision in ("tf32", "fp16", "bf16", "fp8"):
        if precision in rates:
            assert rates[precision] >= rates["fp32"]
    if "fp16" in rates and "bf16" in rates:
        assert rates["bf16"] == rates["fp16"]
    if "fp8" in rates:
        # NVIDIA's L40S datasheet itself is 1.2% off the 2:1 ratio.
        assert rates["fp8"] == pytest.approx(2 * rates["fp16"], rel=0.02)
    if "tf32" in rates:
        assert rates["tf32"] == pytest.approx(rates["fp16"] / 2, rel=0.015)


@pytest.mark.parametrize(("key", "expected_bytes"), [
    ("rtx-3090", 25_769_803_776),   # 24 GiB
    ("v100-16gb", 17_179_869_184),  # 16 GiB
    ("h100-sxm", 85_899_345_920),   # 80 GiB
    ("mi300x", 206_158_430_208),    # 192 GiB
    ("a100-40gb", 42_949_672_960),  # 40 GiB
    ("gtx-1080-ti", 11_811_160_064),  # 11 GiB
    ("rtx-5090", 34_359_738_368),   # 32 GiB
    ("h200", 151_397_597_184),      # 141 GiB
    ("b200", 193_273_528_320),      # 180 GiB (HGX B200)
    ("k80", 12_884_901_888),        # 12 GiB: one of the board's two GPUs
    ("mi250x", 68_719_476_736),     # 64 GiB: one of the module's two GCDs
])
def test_memory_of_well_known_cards(key, expected_bytes):
    assert find_gpu(key).memory_bytes == expected_bytes


@pytest.mark.parametrize(("name", "expected"), [
    ("K80", (3, 7)), ("GTX 1080 Ti", (6, 1)), ("V100", (7, 0)), ("T4", (7, 5)),
    ("A100", (8, 0)), ("A10", (8, 6)), ("RTX 3090", (8, 6)), ("L4", (8, 9)),
    ("RTX 4090", (8, 9)), ("H100", (9, 0)), ("B200", (10, 0)), ("RTX 5090", (12, 0)),
])
def test_compute_capabilities(name, expected):
    assert find_gpu(name).compute_capability == expected


def test_amd_cards_have_a_gfx_arch():
    assert find_gpu("MI250X").arch == "gfx90a"
    assert find_gpu("MI300X").arch == "gfx942"
    assert find_gpu("MI300X").sm_count == 304  # compute units


@pytest.mark.parametrize("gpu", load_catalog(), ids=lambda g: g.key)
def test_formats_only_where_the_hardware_has_them(gpu):
    if gpu.compute_capability is not None:
        ampere_or_later = gpu.compute_capability >= (8, 0)
        assert ("bf16" in gpu.peak_flops) == ampere_or_later
        assert ("tf32" in gpu.peak_flops) == ampere_or_later
        assert ("fp8" in gpu.peak_flops) == (gpu.compute_capability >= (8, 9))
    else:
        # CDNA 3 (gfx942) and CDNA 4 (gfx950, MI355X) have fp8 matrix cores.
        assert ("fp8" in gpu.peak_flops) == (gpu.arch in ("gfx942", "gfx950"))


@pytest.mark.parametrize(("name", "precision", "tflops"), [
    ("A100", "fp32", 19.5), ("A100", "tf32", 156), ("A100", "bf16", 312),
    ("H100 SXM", "fp8", 1978.9), ("H100 PCIe", "bf16", 756),
    ("T4", "fp16", 65), ("V100", "fp16", 125), ("L4", "fp8", 242.5),
    # GeForce: the fp32-accumulate figure, half the fp16-accumulate one.
    ("RTX 4090", "fp16", 165.2), ("RTX 3090", "bf16", 71),
    ("MI300X", "bf16", 1307.4),
])
def test_peak_rates_are_dense_flop_per_second(name, precision, tflops):
    assert find_gpu(name).peak_flops[precision] == pytest.approx(tflops * 1e12)


def test_bandwidth_is_bytes_per_second():
    assert find_gpu("A100 80GB").memory_bandwidth_bytes_per_s == pytest.approx(2.039e12)
    assert find_gpu("A100 40GB").memory_bandwidth_bytes_per_s == pytest.approx(1.555e12)
    assert find_gpu("H100").memory_bandwidth_bytes_per_s == pytest.approx(3.35e12)


# --- name resolution ------------------------------------------------------------


@pytest.mark.parametrize(("key", "name"), [(k, n) for k, names in REQUIRED.items() for n in names])
def test_required_cards_resolve_by_many_names(key, name):
    assert find_gpu(name).key == key


@pytest.mark.parametrize("gpu", load_catalog(), ids=lambda g: g.key)
def test_every_name_of_a_card_resolves_to_that_card(gpu):
    # If two rows shared a name or alias, one of them would resolve elsewhere.
    for name in _every_name(gpu):
        assert find_gpu(name) is gpu, name


@pytest.mark.parametrize("gpu", load_catalog(), ids=lambda g: g.key)
def test_any_name_followed_by_the_cards_memory_resolves(gpu):
    gib = gpu.memory_bytes // GIB
    for name in _every_name(gpu):
        assert find_gpu(f"{name} {gib}GB") is gpu, name
        assert find_gpu(f"{name}-{gib}g") is gpu, name


def test_ambiguous_names_pick_the_common_cloud_variant():
    assert find_gpu("A100").key == "a100-80gb"
    assert find_gpu("H100").key == "h100-sxm"
    assert find_gpu("V100").key == "v100-16gb"


_SEPARATORS = st.sampled_from(["", "", "", " ", "-", "_"])


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_case_and_separators_do_not_matter(data):
    gpu = data.draw(st.sampled_from(load_catalog()))
    name = data.draw(st.sampled_from(_every_name(gpu)))
    mangled = "".join(
        (c.upper() if data.draw(st.booleans()) else c.lower()) + data.draw(_SEPARATORS)
        for c in name)
    assert find_gpu(mangled) is gpu


def test_unknown_name_suggests_the_closest_card():
    with pytest.raises(InvalidInputError) as info:
        find_gpu("RTX 3009")
    assert str(info.value) == (
        "unknown GPU 'RTX 3009': did you mean 'RTX 3090'? (batchfit gpus lists all)")


def test_an_ambiguous_memory_variant_is_not_guessed():
    with pytest.raises(InvalidInputError, match=r"did you mean 'RTX 4060 Ti 16GB'\?"):
        find_gpu("RTX 4060 Ti")


def test_a_hopeless_name_gets_one_line_without_a_suggestion():
    with pytest.raises(InvalidInputError) as info:
        find_gpu("xyz")
    assert str(info.value) == "unknown GPU 'xyz' (batchfit gpus lists all)"


@pytest.mark.parametrize("name", ["", "  ", "--"])
def test_an_empty_name_is_rejected(name):
    with pytest.raises(InvalidInputError, match="empty GPU name"):
        find_gpu(name)


# --- the public surface ---------------------------------------------------------


def test_to_dict_is_json_ready():
    data = json.loads(json.dumps(find_gpu("A100").to_dict()))
    assert data["key"] == "a100-80gb"
    assert data["compute_capability"] == "8.0"
    assert data["arch"] is None
    assert data["peak_flops"]["bf16"] == 312e12
    assert "fp8" not in data["peak_flops"]
    assert "A100" in data["aliases"]
    assert find_gpu("MI300X").to_dict()["compute_capability"] is None


def test_gpus_and_estimates_on_them_pickle():
    """A trace worker sends its summary (which holds the device) back by pickle."""
    import pickle

    from torch import nn

    import batchfit

    gpu = find_gpu("A100")
    back = pickle.loads(pickle.dumps(gpu))
    assert back == gpu and back.peak_flops["bf16"] == 312e12
    with pytest.raises(TypeError):
        back.peak_flops["bf16"] = 0.0  # still read-only
    est = batchfit.estimate(nn.Linear(8, 8), (8,), 4, device="A100")
    assert pickle.loads(pickle.dumps(est)) == est


def test_gpus_are_immutable_and_hashable():
    gpu = find_gpu("A100")
    with pytest.raises(TypeError):
        gpu.peak_flops["fp32"] = 0.0  # type: ignore[index]
    assert len({gpu, find_gpu("a100-80gb"), find_gpu("H100")}) == 2


def test_catalog_is_read_once_and_listed_in_order():
    assert load_catalog() is load_catalog()
    listed = list_gpus()
    assert sorted(g.key for g in listed) == sorted(g.key for g in load_catalog())
    order = [(g.vendor, g.memory_bytes) for g in listed]
    assert order == sorted(order)


def test_importing_the_catalog_does_not_import_torch():
    code = ("import sys, batchfit.device.catalog as c; c.find_gpu('A100'); "
            "sys.exit('torch' in sys.modules)")
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = {**os.environ, "PYTHONPATH": src}
    assert subprocess.run([sys.executable, "-c", code], env=env, check=False).returncode == 0


# --- the live device --------------------------------------------------------------


def _no_cuda() -> bool:
    import torch

    return not torch.cuda.is_available()


@pytest.mark.skipif(not _no_cuda(), reason="checks the message on a machine without CUDA")
@pytest.mark.parametrize("index", [0, 1])
def test_live_gpu_without_cuda_says_what_to_do(index):
    with pytest.raises(InvalidInputError) as info:
        live_gpu(index)
    assert str(info.value) == (
        f"no CUDA device cuda:{index}: this machine has 0 CUDA devices; "
        "use gpu='NAME' to predict for a card you don't have")


def _fake_devices(monkeypatch, props, hip=None):
    """Make torch report one CUDA (or ROCm) device with these properties."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    monkeypatch.setattr(torch.version, "hip", hip)


def _props(name, total_memory, sms, major=0, minor=0, arch="", clock_khz=0, bus_bits=0):
    return SimpleNamespace(name=name, total_memory=total_memory, multi_processor_count=sms,
                           major=major, minor=minor, gcnArchName=arch,
                           memory_clock_rate=clock_khz, memory_bus_width=bus_bits)


def test_live_gpu_index_past_the_last_device(monkeypatch):
    _fake_devices(monkeypatch, _props("NVIDIA A100-SXM4-80GB", 85_174_583_296, 108, 8, 0))
    expected = "no CUDA device cuda:1: this machine has 1 CUDA device;"
    with pytest.raises(InvalidInputError, match=expected):
        live_gpu(1)


def test_live_gpu_takes_memory_from_the_device_and_rates_from_the_catalog(monkeypatch):
    # An A100 80GB reports about 79.3 GiB.
    _fake_devices(monkeypatch, _props("NVIDIA A100-SXM4-80GB", 85_174_583_296, 108, 8, 0))
    gpu = live_gpu(0)
    assert (gpu.key, gpu.name, gpu.vendor) == ("cuda:0", "NVIDIA A100-SXM4-80GB", "nvidia")
    assert gpu.memory_bytes == 85_174_583_296
    assert gpu.compute_capability == (8, 0) and gpu.arch is None
    assert gpu.peak_flops["bf16"] == pytest.approx(312e12)
    assert gpu.memory_bandwidth_bytes_per_s == pytest.approx(2.039e12)
    assert "a100-80gb" in gpu.source
    # its memory is what the device reports: no warning that a marketed figure stands in
    from batchfit.device.profile import gpu_profile, marketed_memory_note

    assert not gpu.memory_is_marketed and marketed_memory_note(gpu_profile(gpu)) is None


def test_live_gpu_with_a_generic_name_matches_by_architecture(monkeypatch):
    _fake_devices(monkeypatch, _props("NVIDIA Graphics Device", 25_438_126_080, 82, 8, 6))
    gpu = live_gpu(0)
    assert gpu.peak_flops["fp16"] == pytest.approx(71e12)  # an RTX 3090


def test_live_gpu_on_rocm_reads_the_gfx_arch(monkeypatch):
    props = _props("AMD Radeon Graphics", 205_822_885_888, 304, 9, 4, "gfx942:sramecc+:xnack-")
    _fake_devices(monkeypatch, props, hip="6.2.0")
    gpu = live_gpu(0)
    assert (gpu.vendor, gpu.arch, gpu.compute_capability) == ("amd", "gfx942", None)
    assert gpu.peak_flops["fp8"] == pytest.approx(2614.9e12)  # an MI300X, not the MI325X


def test_live_gpu_partition_gets_its_share_of_the_card(monkeypatch):
    # A100 80GB MIG 1g.10gb slice: 14 of 108 SMs, about 1/8 of the memory.
    props = _props("NVIDIA A100-SXM4-80GB MIG 1g.10gb", 10_200_547_328, 14, 8, 0)
    _fake_devices(monkeypatch, props)
    gpu = live_gpu(0)
    assert gpu.peak_flops["bf16"] == pytest.approx(312e12 * 14 / 108)
    assert gpu.memory_bandwidth_bytes_per_s == pytest.approx(2.039e12 * 10_200_547_328 / (80 * GIB))


def test_live_gpu_unknown_to_the_catalog_estimates_bandwidth(monkeypatch):
    # RTX 6000 Ada as reported by the driver: 10,001,000 kHz memory clock, 384-bit bus.
    props = _props("Some Future Card", 51_010_207_744, 999, 9, 9,
                   clock_khz=10_001_000, bus_bits=384)
    _fake_devices(monkeypatch, props)
    gpu = live_gpu(0)
    assert dict(gpu.peak_flops) == {}
    assert gpu.memory_bandwidth_bytes_per_s == pytest.approx(960.096e9)


def test_live_gpu_unknown_to_the_catalog_on_an_old_torch(monkeypatch):
    props = _props("Some Future Card", 51_010_207_744, 999, 9, 9)  # no memory clock reported
    _fake_devices(monkeypatch, props)
    with pytest.raises(InvalidInputError, match=r"use gpu='NAME' with the closest card"):
        live_gpu(0)


@pytest.mark.gpu
@pytest.mark.skipif(_no_cuda(), reason="needs a CUDA device")
def test_live_gpu_on_a_real_device():
    import torch

    gpu = live_gpu(0)
    assert gpu.memory_bytes == torch.cuda.get_device_properties(0).total_memory
    assert math.isfinite(gpu.memory_bandwidth_bytes_per_s)


def test_memory_used_by_others_is_none_without_nvml(monkeypatch):
    import sys

    from batchfit.device.catalog import memory_used_by_others

    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    assert memory_used_by_others(object()) is None


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_live_memory_leaves_out_what_other_processes_hold():
    import torch

    from batchfit.device.catalog import memory_used_by_others

    props = torch.cuda.get_device_properties(0)
    others = memory_used_by_others(props) or 0
    assert live_gpu(0).memory_bytes == props.total_memory - others


# --- a card's architecture with other memory --------------------------------------


def test_with_memory_keeps_the_architecture_and_replaces_the_memory():
    card = find_gpu("RTX 5090")
    bigger = card.with_memory(48 * GIB)
    assert bigger.memory_bytes == 51_539_607_552  # 48 * 2**30
    assert (bigger.compute_capability, bigger.sm_count) == ((12, 0), 170)
    assert bigger.peak_flops == card.peak_flops and bigger.name == card.name
    assert card.memory_bytes == 32 * GIB  # the catalog's card is untouched


@pytest.mark.parametrize("bad", [0, -1, 1.5, "48GiB", True])
def test_with_memory_refuses_what_is_not_a_positive_byte_count(bad):
    with pytest.raises(InvalidInputError, match="positive number of bytes"):
        find_gpu("A100").with_memory(bad)


def test_gpu_profile_with_memory_is_that_card_with_that_memory():
    from batchfit.device.profile import gpu_profile

    profile = gpu_profile(find_gpu("H100"), memory_bytes=40 * GIB)
    assert profile.total_memory_bytes == 40 * GIB
    assert profile.compute_capability == (9, 0) and profile.sm_count == 132
    # torch's cuBLAS and cuBLASLt workspaces from sm90 on: 32 MiB each.
    assert profile.workspace_bytes == 2 * 32 * 2**20
    assert profile.extra["gpu"].memory_bytes == 40 * GIB
    assert profile.extra["gpu"].peak_flops["bf16"] == pytest.approx(989.4e12)


def test_gpu_profile_refuses_memory_the_overheads_fill():
    from batchfit.device.profile import gpu_profile
    from batchfit.errors import MemoryBelowOverheadError

    # T4 (sm75): the 512 MiB context + 2 x 8.125 MiB cuBLAS workspaces = 553,910,272 B.
    with pytest.raises(MemoryBelowOverheadError) as info:
        gpu_profile(find_gpu("T4"), memory_bytes=512 * 2**20)
    assert (info.value.needed_bytes, info.value.given_bytes) == (553_910_272, 536_870_912)
    assert "536,870,912 B is below the 553,910,272 B" in str(info.value)
    assert len(str(info.value).splitlines()) == 1
    # The same memory holds a smaller context.
    profile = gpu_profile(find_gpu("T4"), memory_bytes=512 * 2**20, context_bytes=0)
    assert profile.context_bytes == 0 and profile.total_memory_bytes == 512 * 2**20


def test_a_card_with_other_memory_is_the_documented_library_way():
    import batchfit

    est = batchfit.estimate(lambda: __import__("torch").nn.Linear(64, 64), (64,), 8,
                            device=batchfit.gpu_profile(batchfit.find_gpu("L4"), 12 * GIB))
    assert est.device.total_memory_bytes == 12 * GIB
    assert est.device.compute_capability == (8, 9)


# --- the cards added for issue 13 ------------------------------------------------------
# Expected values are the datasheets' own figures, or the arithmetic written beside them.

NEW_CARDS = {
    "rtx-pro-6000-blackwell-server": [
        "RTX PRO 6000", "RTX PRO 6000 Blackwell", "PRO 6000", "rtx pro 6000 96gb",
        "NVIDIA RTX PRO 6000 Blackwell Server Edition", "RTX PRO 6000 Server"],
    "rtx-pro-6000-blackwell-ws": [
        "RTX PRO 6000 Workstation Edition", "NVIDIA RTX PRO 6000 Blackwell Workstation Edition",
        "RTX PRO 6000 WS"],
    "rtx-pro-6000-blackwell-max-q": [
        "RTX PRO 6000 Max-Q", "PRO 6000 Blackwell Max-Q", "RTX PRO 6000 Blackwell Max-Q",
        "NVIDIA RTX PRO 6000 Blackwell Max-Q Workstation Edition", "rtx-pro-6000-maxq"],
    "rtx-pro-5000-blackwell": ["RTX PRO 5000", "RTX PRO 5000 Blackwell", "RTX PRO 5000 48GB"],
    "rtx-pro-5000-blackwell-72gb": ["RTX PRO 5000 72GB", "NVIDIA RTX PRO 5000 72GB Blackwell"],
    "rtx-pro-4500-blackwell": ["RTX PRO 4500", "NVIDIA RTX PRO 4500 Blackwell"],
    "rtx-pro-4000-blackwell": ["RTX PRO 4000", "PRO 4000 Blackwell"],
    "rtx-5070-ti": ["5070 Ti", "RTX 5070 Ti", "NVIDIA GeForce RTX 5070 Ti", "rtx5070ti 16gb"],
    "rtx-5070": ["5070", "RTX 5070", "NVIDIA GeForce RTX 5070"],
    "rtx-5060-ti-16gb": ["RTX 5060 Ti 16GB", "5060 Ti 16GB", "GeForce RTX 5060 Ti 16 GB"],
    "h20": ["H20", "NVIDIA H20", "h20 96gb"],
    "a10g": ["A10G", "NVIDIA A10G", "a10g 24gb"],
    "h800-sxm": ["H800", "NVIDIA H800", "H800 SXM", "H800 80GB"],
    "a800-80gb": ["A800", "A800 80GB", "NVIDIA A800-SXM4-80GB"],
    "l20": ["L20", "NVIDIA L20", "l20 48gb"],
    "b300": ["B300", "NVIDIA B300 SXM6 AC", "HGX B300", "B300 288GB"],
    "gb200": ["GB200", "NVIDIA GB200", "GB200 NVL72"],
    "mi355x": ["MI355X", "AMD Instinct MI355X", "instinct mi355x"],
    "jetson-agx-orin-64gb": ["AGX Orin", "Jetson AGX Orin", "Jetson AGX Orin 64GB", "Orin"],
}


@pytest.mark.parametrize(("key", "name"), [(k, n) for k, names in NEW_CARDS.items() for n in names])
def test_new_cards_resolve_by_the_names_users_type(key, name):
    assert find_gpu(name).key == key


@pytest.mark.parametrize(("name", "variant"), [("RTX 5060 Ti", "RTX 5060 Ti 16GB"),
                                               ("5060 Ti", "5060 Ti 16GB")])
def test_the_bare_5060_ti_names_the_variant_the_catalog_has(name, variant):
    # 8 GB and 16 GB cards are equally common: not guessed, and not confused with the 5070 Ti
    # one character away.
    with pytest.raises(InvalidInputError) as info:
        find_gpu(name)
    assert str(info.value) == (
        f"unknown GPU {name!r}: did you mean {variant!r}? (batchfit gpus lists all)")


@pytest.mark.parametrize(("key", "expected_bytes"), [
    ("rtx-pro-6000-blackwell-ws", 103_079_215_104),     # 96 GiB
    ("rtx-pro-6000-blackwell-max-q", 103_079_215_104),  # 96 GiB
    ("rtx-pro-6000-blackwell-server", 103_079_215_104),  # 96 GiB
    ("rtx-pro-5000-blackwell", 51_539_607_552),         # 48 GiB
    ("rtx-pro-5000-blackwell-72gb", 77_309_411_328),    # 72 GiB
    ("rtx-pro-4500-blackwell", 34_359_738_368),         # 32 GiB
    ("rtx-pro-4000-blackwell", 25_769_803_776),         # 24 GiB
    ("rtx-5070-ti", 17_179_869_184),                    # 16 GiB
    ("rtx-5070", 12_884_901_888),                       # 12 GiB
    ("rtx-5060-ti-16gb", 17_179_869_184),               # 16 GiB
    ("h20", 103_079_215_104),                           # 96 GiB
    ("h800-sxm", 85_899_345_920),                       # 80 GiB
    ("a800-80gb", 85_899_345_920),                      # 80 GiB
    ("l20", 51_539_607_552),                            # 48 GiB
    ("b300", 287_762_808_832),  # 268 GiB: CUDA's 275,040 MiB = 268.6 GiB, rounded down
    ("gb200", 199_715_979_264),                         # 186 GiB per GPU
    ("mi355x", 309_237_645_312),                        # 288 GiB
    ("jetson-agx-orin-64gb", 68_719_476_736),           # 64 GiB, shared with the CPU
])
def test_memory_of_new_cards(key, expected_bytes):
    assert find_gpu(key).memory_bytes == expected_bytes


def test_the_dev_brackets_card_is_within_half_a_percent_of_what_nvidia_smi_reports():
    # The brackets' README: nvidia-smi reports about 97,887 MiB for the RTX PRO 6000 Max-Q.
    gpu = find_gpu("RTX PRO 6000 Blackwell Max-Q")
    reported = 97_887 * 2**20
    assert 0 < gpu.memory_bytes - reported < 0.005 * reported


@pytest.mark.parametrize(("name", "cc", "sm_count"), [
    # SM counts: CUDA cores / 128 per SM where the vendor prints cores.
    ("RTX PRO 6000 Blackwell Max-Q", (12, 0), 188),  # 24,064 cores
    ("RTX PRO 6000 Workstation Edition", (12, 0), 188),
    ("RTX PRO 5000", (12, 0), 110),                  # 14,080 cores
    ("RTX PRO 4500", (12, 0), 82),                   # 10,496 cores
    ("RTX PRO 4000", (12, 0), 70),                   # 8,960 cores
    ("RTX 5070 Ti", (12, 0), 70),                    # 8,960 cores
    ("RTX 5070", (12, 0), 48),                       # 6,144 cores
    ("RTX 5060 Ti 16GB", (12, 0), 36),               # 4,608 cores
    ("H20", (9, 0), 78),
    ("H800", (9, 0), 132),
    ("A800", (8, 0), 108),
    ("L20", (8, 9), 92),                             # 11,776 cores
    ("B300", (10, 3), 148),                          # sm_103
    ("GB200", (10, 0), 148),
    ("AGX Orin", (8, 7), 16),                        # 2,048 cores
])
def test_new_cards_architecture(name, cc, sm_count):
    gpu = find_gpu(name)
    assert (gpu.compute_capability, gpu.sm_count) == (cc, sm_count)


def test_mi355x_is_cdna4():
    gpu = find_gpu("MI355X")
    assert (gpu.arch, gpu.sm_count, gpu.compute_capability) == ("gfx950", 256, None)
    assert "tf32" not in gpu.peak_flops  # AMD publishes no TF32 rate for it


@pytest.mark.parametrize(("name", "precision", "tflops"), [
    # Workstation cards: NVIDIA's 125 TFLOPS fp32 and 4000 AI TOPS (FP4, sparse): bf16 = 4000/8.
    ("RTX PRO 6000 Workstation Edition", "fp32", 125), ("RTX PRO 6000 WS", "bf16", 500),
    ("RTX PRO 6000 Max-Q", "fp8", 3511 / 4), ("RTX PRO 5000", "bf16", 2064 / 8),
    # GeForce: fp32 = 70 SMs x 128 FMA x 2 x 2.452 GHz; fp16 (fp32 accumulate) = 1406 AI TOPS / 16.
    ("RTX 5070 Ti", "fp32", 43.9), ("RTX 5070 Ti", "fp16", 87.9),
    ("H20", "bf16", 148), ("H800", "fp8", 1978.9),
    # HGX B300: 36 PFLOPS fp16 with sparsity for 8 GPUs -> 36000 / 8 / 2.
    ("B300", "bf16", 2250),
    # GB200 NVL72: 720 PFLOPS fp8 with sparsity for 72 GPUs -> 720000 / 72 / 2.
    ("GB200", "fp8", 5000),
    ("MI355X", "bf16", 2500), ("MI355X", "fp32", 157.3),
    # Orin: 2,048 cores x 2 x 1.3 GHz = 5.32 TFLOPS; 170 sparse INT8 TOPS -> 85 dense -> 42.5 fp16.
    ("AGX Orin", "fp32", 5.3), ("AGX Orin", "fp16", 42.5),
])
def test_new_cards_peak_rates(name, precision, tflops):
    assert find_gpu(name).peak_flops[precision] == pytest.approx(tflops * 1e12, rel=1e-3)


def test_only_the_jetson_shares_its_memory_with_the_cpu():
    from batchfit.device.profile import gpu_profile

    assert [g.key for g in load_catalog() if g.unified_memory] == ["jetson-agx-orin-64gb"]
    profile = gpu_profile(find_gpu("AGX Orin"))
    assert profile.unified_memory and profile.to_dict()["unified_memory"] is True
    assert find_gpu("AGX Orin").to_dict()["unified_memory"] is True
    assert not gpu_profile(find_gpu("A100")).unified_memory


def test_a_live_jetson_gets_the_memory_the_kernel_has_available(monkeypatch):
    from batchfit.device import catalog

    # An AGX Orin as torch reports it: name "Orin", 16 SMs, sm_87, integrated, all of the
    # module's memory as total_memory (this figure is illustrative).
    props = _props("Orin", 61 * GIB, 16, 8, 7)
    props.is_integrated = 1
    _fake_devices(monkeypatch, props)
    monkeypatch.setattr(catalog, "host_memory_available_bytes", lambda: 40 * GIB)
    gpu = live_gpu(0)
    assert gpu.memory_bytes == 40 * GIB and gpu.unified_memory
    assert gpu.peak_flops["fp16"] == pytest.approx(42.5e12)  # the AGX Orin row's rates
    assert "MemAvailable" in gpu.source
    # A discrete card never reads the host's memory.
    _fake_devices(monkeypatch, _props("NVIDIA A100-SXM4-80GB", 85_174_583_296, 108, 8, 0))
    assert live_gpu(0).memory_bytes == 85_174_583_296 and not live_gpu(0).unified_memory


def test_host_memory_available_reads_meminfo(tmp_path):
    from batchfit.device.catalog import host_memory_available_bytes

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       65881152 kB\nMemFree:         1024 kB\n"
                       "MemAvailable:   41943040 kB\n")
    assert host_memory_available_bytes(str(meminfo)) == 41_943_040 * 1024  # 40 GiB
    meminfo.write_text("MemTotal:       65881152 kB\n")  # kernels before 3.14 lack the line
    assert host_memory_available_bytes(str(meminfo)) is None
    assert host_memory_available_bytes(str(tmp_path / "absent")) is None


# --- what CUDA reports as the total (the driver keeps the rest) ---------------------


def test_cuda_total_rows_have_a_source_and_sit_below_the_marketed_memory():
    with_total = [g for g in load_catalog() if g.cuda_total_bytes is not None]
    assert {g.key for g in with_total} >= {"rtx-3090", "rtx-4090", "rtx-5090", "v100-16gb",
                                           "v100-32gb", "rtx-pro-6000-blackwell-max-q"}
    for gpu in with_total:
        assert urlparse(gpu.cuda_total_source).scheme == "https", gpu.key
        # A few hundred MiB (24 GB cards) to about 1 GiB (96 GB cards) below; GDDR6 cards
        # with ECC on (T4, A10) also lose the 1/16 that holds the check bits.
        assert 0.90 * gpu.memory_bytes < gpu.cuda_total_bytes < gpu.memory_bytes, gpu.key
        assert gpu.usable_memory_bytes == gpu.cuda_total_bytes


def _quoted_total_mib(source: str) -> int:
    """The MiB a row's quoted report gives: exact bytes (deviceQuery's, XLA's
    ``device_memory_size``) rounded down, a whole-MiB figure (torch's ``total_memory=``,
    nvbench's "MiB Total", a "MB" figure), or torch's two-decimal GiB (exact to +-5 MiB)
    times 1024 rounded down, as the catalog says."""
    import re

    quote = source.split(" | ", 1)[1]
    for exact in (r"MBytes \((\d+) bytes\)", r"device_memory_size: (\d+)"):
        if found := re.search(exact, quote):
            return int(found.group(1)) // 2**20
    if found := re.search(r"Size: (\d+)\(0x[0-9a-f]+\) KB", quote):  # rocminfo's pool, KiB
        return int(found.group(1)) // 1024
    for whole in (r"total_memory=(\d+)MB", r"(\d+) MiB Total", r"(\d+) MB\b"):
        if found := re.search(whole, quote):
            return int(found.group(1))
    hundredths = re.search(r"(\d+)\.(\d\d) GiB", quote)
    assert hundredths, quote
    return (int(hundredths.group(1)) * 100 + int(hundredths.group(2))) * 1024 // 100


def test_every_cuda_total_matches_the_figure_its_source_quotes():
    with_total = [g for g in load_catalog() if g.cuda_total_bytes is not None]
    # the datacenter cards whose public reports were found (the rest stay empty)
    assert {g.key for g in with_total} >= {
        "t4", "a100-40gb", "a100-pcie-80gb", "a10", "l40", "h100-sxm", "h200", "b200",
        "a100-80gb", "a100-pcie-40gb", "a30", "a40", "l4", "l40s", "h100-pcie", "h100-nvl",
        "h20", "gh200", "gb200", "mi300x", "rtx-a6000", "rtx-6000-ada", "rtx-4000-ada",
        "rtx-4060-ti-16gb", "a800-80gb", "mi210", "mi250", "mi250x", "l20"}
    for gpu in with_total:
        url, _, quote = gpu.cuda_total_source.partition(" | ")
        assert urlparse(url).scheme == "https" and quote, gpu.key
        assert gpu.cuda_total_bytes == _quoted_total_mib(gpu.cuda_total_source) * 2**20, gpu.key


def test_the_a10g_is_its_own_card_not_the_a10():
    # AWS's A10G: 80 SMs where the A10 has 72 (torch's multi_processor_count=80 print), and
    # its own total: vllm-project/vllm#372's "22.19 GiB total capacity" on a g5 instance,
    # 22.19 x 1024 = 22,722.56 MiB, rounded down
    a10g, a10 = find_gpu("A10G"), find_gpu("A10")
    assert (a10g.key, a10g.sm_count, a10g.compute_capability) == ("a10g", 80, (8, 6))
    assert a10g.cuda_total_bytes == 22_722 * 2**20
    assert (a10.key, a10.sm_count, a10.cuda_total_bytes) == ("a10", 72, 22_517 * 2**20)


def test_quoted_figures_convert_as_the_catalog_says():
    # 14.76 GiB = 15,114.24 MiB -> 15,114; deviceQuery's 42,298,834,944 B = 40,339.3 MiB
    assert _quoted_total_mib("u | 14.76 GiB total capacity") == 15_114
    assert _quoted_total_mib("u | total capacity of 44.40 GiB") == 45_465
    assert _quoted_total_mib("u | global memory: 40339 MBytes (42298834944 bytes)") == 40_339
    assert _quoted_total_mib("u | Total global mem: 81049 MB") == 81_049
    # torch's repr prints total_memory // 2**20; nvbench prints cudaMemGetInfo's total // 2**20
    assert _quoted_total_mib("u | name='NVIDIA H20', total_memory=97285MB") == 97_285
    assert _quoted_total_mib("u | Global Memory: 23805 MiB Free / 24060 MiB Total") == 24_060
    # XLA's device_memory_size is cuDeviceTotalMem in bytes: 84,942,979,072 B = 81,007.94 MiB
    assert _quoted_total_mib("u | device_memory_size: 84942979072") == 81_007
    # rocminfo's pool in KiB: 67,092,480 KiB = 65,520 MiB exactly (64 GiB less 16 MiB)
    assert _quoted_total_mib("u | Segment: GLOBAL; Size: 67092480(0x3ffc000) KB") == 65_520


def test_rocminfo_pool_size_is_what_torch_reports_as_the_total():
    # One card, two public reports: rocminfo's MI300X pool (ROCm/rocm-examples#187, "Size:
    # 201310208(0xbffc000) KB") and torch's total_memory=196592MB (ROCm/ROCm#4203, the row's
    # source): 201,310,208 / 1024 = 196,592 exactly; so rocminfo's pool stands for the
    # total on the MI200 rows
    assert _quoted_total_mib("u | Size: 201310208(0xbffc000) KB") == 196_592
    assert find_gpu("MI300X").cuda_total_bytes == 196_592 * 2**20
    for name in ("MI210", "MI250", "MI250X"):
        assert find_gpu(name).cuda_total_bytes == 65_520 * 2**20, name
    # the A800: two reports of its OOM message agree (PB-LLM#3, MoonshotAI/Kimi-VL#51):
    # 79.33 GiB x 1024 = 81,233.92 MiB, rounded down; above the A100 80GB SXM row's 79.25
    assert find_gpu("A800").cuda_total_bytes == 81_233 * 2**20


def test_the_l20_reports_what_its_ecc_on_ada_siblings_do():
    # Tencent-Hunyuan/HunyuanCustom#36, on 8 L20s: "a total capacity of 44.53 GiB", 45,598
    # MiB; the L40S (the same 48 GB GDDR6 AD102 board class, ECC on) reports 44.52 GiB
    l20, l40s = find_gpu("L20"), find_gpu("L40S")
    assert l20.cuda_total_bytes == 45_598 * 2**20
    assert abs(l20.cuda_total_bytes - l40s.cuda_total_bytes) <= 10 * 2**20


def test_a_t4_reports_what_torch_printed_on_one():
    # deviceQuery: 15,843,721,216 B = 15,109.75 MiB (ECC on, as datacenter T4s ship), which
    # torch prints as 14.76 GiB: the "14.76 GiB total capacity" of another T4's OOM message
    gpu = find_gpu("T4")
    assert gpu.usable_memory_bytes == 15_109 * 2**20  # rounded down to whole MiB
    assert f"{15_843_721_216 / GIB:.2f}" == "14.76"


def test_a_3090_reports_23_70_gib_of_its_24():
    gpu = find_gpu("RTX 3090")
    # torch: "23.70 GiB total capacity"; 23.70 * 1024 = 24,268.8, rounded down to MiB.
    assert gpu.usable_memory_bytes == 24_268 * 2**20 == 25_446_842_368
    assert f"{gpu.usable_memory_bytes / GIB:.2f}" == "23.70"
    assert gpu.memory_bytes == 24 * GIB  # the marketed figure, which names resolve by
    assert find_gpu("RTX 3090 24GB") is gpu
    assert gpu.to_dict()["cuda_total_bytes"] == 25_446_842_368


def test_cards_filled_from_exact_reports_round_down_to_whole_mib():
    # deviceQuery on an L4 (ECC on): 23,612,293,120 B = 22,518.44 MiB; on an A100-SXM4-80GB
    # 85,100,068,864 B = 81,157.75 MiB (deviceQuery prints the rounded 81158 MBytes);
    # XLA's GB200 spec 197,897,748,480 B = 188,730 MiB exactly, 184.31 GiB of its 186;
    # torch on an MI300X prints total_memory=196592MB, 16 MiB short of 192 GiB.
    assert find_gpu("L4").usable_memory_bytes == 22_518 * 2**20
    assert find_gpu("A100").usable_memory_bytes == 81_157 * 2**20
    assert find_gpu("GB200").usable_memory_bytes == 188_730 * 2**20 == 197_897_748_480
    assert find_gpu("MI300X").usable_memory_bytes == 192 * GIB - 16 * 2**20
    assert find_gpu("L4").memory_bytes == 24 * GIB  # the marketed figure names resolve by


def test_hopper_and_blackwell_hbm_cards_report_what_torch_printed_on_them():
    # torch's OOM messages on an H200 node and a B200 (stas00/ml-engineering, debug/
    # pytorch.md): "total capacity of 139.80 GiB" and "of 178.35 GiB";
    # 139.80 * 1024 = 143,155.2 and 178.35 * 1024 = 182,630.4 MiB, rounded down.
    assert find_gpu("H200").usable_memory_bytes == 143_155 * 2**20
    assert find_gpu("B200").usable_memory_bytes == 182_630 * 2**20
    assert find_gpu("H200").memory_bytes == 141 * GIB  # the marketed figure stays
    assert find_gpu("B200").memory_bytes == 180 * GIB


def test_a_card_without_a_report_keeps_its_memory():
    gpu = find_gpu("H800")  # no public report names the card and prints CUDA's total
    assert gpu.cuda_total_bytes is None and gpu.cuda_total_source == ""
    assert gpu.usable_memory_bytes == gpu.memory_bytes == 80 * GIB


def test_the_profile_of_a_catalog_card_has_what_cuda_reports():
    from batchfit.device.profile import gpu_profile, resolve_device

    assert resolve_device("RTX 3090").total_memory_bytes == 25_446_842_368
    assert gpu_profile(find_gpu("H800")).total_memory_bytes == 80 * GIB
    assert resolve_device("A100").total_memory_bytes == 81_157 * 2**20


def test_given_memory_is_the_total_cuda_would_report():
    """--gpu NAME --memory SIZE: SIZE is the whole, nothing is kept back from it."""
    from batchfit.device.profile import gpu_profile

    card = find_gpu("RTX 3090").with_memory(24 * GIB)
    assert card.cuda_total_bytes is None and card.usable_memory_bytes == 24 * GIB
    assert gpu_profile(find_gpu("RTX 3090"), memory_bytes=24 * GIB).total_memory_bytes == 24 * GIB


@pytest.mark.parametrize("card, total, workspaces", [
    ("RTX 3090", 25_446_842_368, 2 * 8_519_680),  # 23.70 GiB; sm86: two 8.125 MiB workspaces
    ("L4", 22_518 * 2**20, 2 * 8_519_680),  # deviceQuery's 22,518.44 MiB; sm89 as sm86
    ("H100 PCIe", 81_007 * 2**20, 2 * 32 * 2**20),  # XLA's 81,007.94 MiB; sm90: 2 x 32 MiB
])
def test_max_budget_on_a_catalog_card_starts_from_what_cuda_reports(card, total, workspaces):
    import torch

    import batchfit

    result = batchfit.max_batch_size(lambda: torch.nn.Linear(64, 64), (64,), device=card,
                                     max_batch_limit=8)
    assert result.memory_bytes == total
    # Less the lazy-loading context (512 MiB) and the architecture's cuBLAS workspaces.
    assert result.budget_bytes == total - 536_870_912 - workspaces


@pytest.mark.parametrize("mib, source, message", [
    ("24268", "", "go together"), ("", "https://x", "go together"),
    ("30000", "https://x", "at most memory_bytes"), ("0", "https://x", "positive")])
def test_a_malformed_cuda_total_is_refused(mib, source, message):
    from batchfit.device.catalog import _parse_cuda_total

    with pytest.raises(ValueError, match=message):
        _parse_cuda_total({"cuda_total_mib": mib, "cuda_total_source": source,
                           "memory_bytes": str(24 * GIB)})


def test_choose_gpu_names_the_variants_a_short_name_leaves_open():
    from batchfit.device.catalog import choose_gpu

    assert {g.key for g in choose_gpu("H100").alternatives} == {"h100-pcie", "h100-nvl"}
    assert {g.key for g in choose_gpu("A100").alternatives} == {
        "a100-40gb", "a100-pcie-40gb", "a100-pcie-80gb"}
    # AWS's A10G is the A10's variant: "A10" names the A10 and says the A10G exists
    assert {g.key for g in choose_gpu("A10").alternatives} == {"a10g"}
    # another card, not a variant: L40S of L40, A100 of A10, RTX 3080 Ti of RTX 3080
    for name in ("L40", "A10G", "RTX 3080", "T4", "NVIDIA A100 80GB SXM"):
        assert not choose_gpu(name).ambiguous, name
