"""Targets: the packaged YAML files, the host detection and its cache, the schema's error
messages, and ``parse_size`` for ``--vram``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from picc.errors import PiccError
from picc.targets import SIMD_LEVELS, host, load_target, parse_duration, parse_size, target_names

VALID: dict[str, Any] = {
    "name": "pc-x",
    "gpu": {"name": "Some GPU", "arch": "sm_75", "vram": "11GiB", "mem_bandwidth": "616GB/s"},
    "pcie_bandwidth": "12GB/s",
    "cpu": {"name": "Some CPU", "cores": 8, "mem_bandwidth": "38.4GB/s", "simd": "avx2"},
}


def write(tmp_path: Path, data: object, name: str = "pc-x.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def test_packaged_targets() -> None:
    assert target_names() == ("cpu", "h100", "pc-high", "pc-low")

    h100 = load_target("h100")
    assert h100.gpu is not None
    assert (h100.gpu.arch, h100.gpu.vram_bytes, h100.gpu.mem_bandwidth) == ("sm_90", 79 * 2**30, 3000e9)
    assert (h100.cpu.cores, h100.cpu.simd) == (16, "avx512")
    # The fixed costs measured there (bench/gpu), against the defaults of the targets not measured.
    assert (h100.gpu.kernel_overhead, h100.gpu.sync_overhead, h100.pcie_latency) == pytest.approx((1.8e-6, 30e-6, 4e-6))

    high = load_target("pc-high")
    assert high.gpu is not None
    assert (high.gpu.arch, high.gpu.vram_bytes, high.gpu.mem_bandwidth) == ("sm_89", 24564 * 2**20, 1008e9)
    assert high.pcie_bandwidth == 25e9
    assert (high.cpu.cores, high.cpu.mem_bandwidth, high.cpu.simd) == (8, 67.2e9, "avx2")

    low = load_target("pc-low")
    assert low.gpu is not None
    assert (low.gpu.arch, low.gpu.vram_bytes, low.gpu.mem_bandwidth) == ("sm_75", 11 * 2**30, 616e9)
    assert low.vram_bytes == 11_811_160_064
    assert low.pcie_bandwidth == 12e9
    assert (low.cpu.cores, low.cpu.mem_bandwidth, low.cpu.simd) == (8, 38.4e9, "avx2")
    assert "2080 Ti" in low.gpu.name and "12700K" in low.cpu.name
    assert (low.gpu.kernel_overhead, low.gpu.sync_overhead, low.pcie_latency) == (4e-6, 30e-6, 15e-6)
    assert load_target("cpu").pcie_latency == 0.0


@pytest.mark.parametrize(("text", "seconds"), [("3us", 3e-6), ("2.7 us", 2.7e-6), ("0.02ms", 2e-5), ("500ns", 5e-7),
                                               ("1e-5", 1e-5), ("15µs", 15e-6)])
def test_parse_duration(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "us", "3 weeks", "-3us", "3usec"])
def test_parse_duration_rejects(text: str) -> None:
    assert parse_duration(text) is None


def test_cpu_target_uses_the_cached_bandwidth(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PICC_CACHE_DIR", str(tmp_path))
    cache = host.host_cache_path()
    cache.parent.mkdir(parents=True)
    cache.write_text(json.dumps({"version": host.HOST_CACHE_VERSION, "cpu": host.host_cpu_name(),
                                 "cores": host.host_cores(), "kernels": host.kernels_fingerprint(),
                                 "mem_bandwidth": 12.5e9,
                                 "kernel_rates": {"q4_1": 6e9, "f16": 40e9}}))
    monkeypatch.setattr(host, "measure_memory_bandwidth", lambda: pytest.fail("measured despite the cache"))
    monkeypatch.setattr(host, "measure_kernel_rates", lambda threads: pytest.fail("measured despite the cache"))

    cpu = load_target("cpu")
    assert cpu.gpu is None and cpu.pcie_bandwidth == 0 and cpu.vram_bytes == 0
    assert cpu.cpu.mem_bandwidth == 12.5e9
    # A kernel reads at its measured rate, at most the bandwidth; unknown formats at the bandwidth.
    assert (cpu.cpu.read_rate("q4_1"), cpu.cpu.read_rate("f16"), cpu.cpu.read_rate("q8_0")) == (6e9, 12.5e9, 12.5e9)
    assert cpu.cpu.cores == host.host_cores() >= 1
    assert cpu.cpu.simd in SIMD_LEVELS


def _cache(**fields: object) -> str:
    here = {"version": host.HOST_CACHE_VERSION, "cpu": host.host_cpu_name(), "cores": host.host_cores(),
            "kernels": host.kernels_fingerprint(), "mem_bandwidth": 1e9, "kernel_rates": {"q4_0": 1e9}}
    return json.dumps({key: value for key, value in {**here, **fields}.items() if value is not None})


@pytest.mark.parametrize("cached", [
    None, "not json", _cache(cpu="another CPU"), _cache(version=2), _cache(version=1),
    _cache(cores=host.host_cores() + 1),  # rates are for all the cores: another count, another CPU
    _cache(kernel_rates=None),  # a cache written before kernel rates
    _cache(kernels="0" * 16),  # rates of another code generator's kernels
])
def test_cpu_target_measures_once_per_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cached: str | None) -> None:
    monkeypatch.setenv("PICC_CACHE_DIR", str(tmp_path))
    if cached is not None:
        host.host_cache_path().parent.mkdir(parents=True)
        host.host_cache_path().write_text(cached)
    calls = []
    monkeypatch.setattr(host, "measure_memory_bandwidth", lambda: calls.append("bw") or 20e9)
    monkeypatch.setattr(host, "measure_kernel_rates", lambda threads: calls.append(threads) or {"q4_1": 5e9})
    for _ in range(2):
        cpu = load_target("cpu").cpu
        assert cpu.mem_bandwidth == 20e9 and cpu.kernel_rates == (("q4_1", 5e9),)
    assert calls == ["bw", host.host_cores()]
    assert json.loads(host.host_cache_path().read_text())["cpu"] == host.host_cpu_name()


def test_kernel_rates_are_measured_for_every_format() -> None:
    from picc.codegen_cpu.rates import measure_kernel_rates
    from picc.kernel_names import CPU_RATE_KEYS

    rates = measure_kernel_rates(1, repeats=1, nbytes=2**20)
    assert set(rates) == set(CPU_RATE_KEYS) and all(0 < r < float("inf") for r in rates.values())


def test_each_rate_key_is_timed_with_the_kernel_it_names() -> None:
    # 4-bit rows one at a time read int8 x as int16 and share the _xi16 key: that key is timed
    # with the int16 kernel, the _r8_xi8 keys with the int8 one.
    # The _gathered keys are the fused sparse FFN's, dotting x as the key says.
    from picc.kernel_names import (
        CPU_GATHERED_RATE_KEYS,
        CPU_GEMV_RATE_KEYS,
        CPU_RATE_KEYS,
        cpu_fused_ffn,
        cpu_gathered_rate_variants,
        cpu_gemv,
        cpu_rate_variants,
    )

    variants = cpu_rate_variants()
    assert [key for key, *_ in variants] == list(CPU_GEMV_RATE_KEYS)
    for key, dtype, x_format, rows8 in variants:
        assert cpu_gemv(dtype, x_format, rows8) == f"picc_gemv_{key}", key
    gathered = cpu_gathered_rate_variants()
    assert [key for key, *_ in gathered] == list(CPU_GATHERED_RATE_KEYS)
    assert set(CPU_RATE_KEYS) == set(CPU_GEMV_RATE_KEYS) | set(CPU_GATHERED_RATE_KEYS)
    for key, dtype, x_format in gathered:
        assert key.startswith(f"{dtype}_gathered") and key.endswith("_xi16") == (x_format == "i16"), key
        symbol = cpu_fused_ffn("predictor", "relu", dtype, None, dtype, False, x_format, False)
        assert symbol.endswith("_xi16") == (x_format == "i16"), (key, symbol)


def test_kernel_rates_in_a_target_file(tmp_path: Path) -> None:
    data = replaced("cpu", "kernel_rates", {"q4_1": "14GB/s", "q4_0_xi16": 2e10})
    cpu = load_target(str(write(tmp_path, data))).cpu
    assert cpu.kernel_rates == (("q4_0_xi16", 2e10), ("q4_1", 14e9))
    assert (cpu.read_rate("q4_1"), cpu.read_rate("q4_0_xi16"), cpu.read_rate("f32")) == (14e9, 20e9, 38.4e9)
    # A gathered key not given reads at the one-row rate of the same rows; given, at its own.
    assert (cpu.read_rate("q4_1_gathered"), cpu.read_rate("q4_0_gathered_xi16")) == (14e9, 20e9)
    cpu = load_target(str(write(tmp_path, replaced("cpu", "kernel_rates", {"q4_1": 14e9, "q4_1_gathered": 9e9})))).cpu
    assert (cpu.read_rate("q4_1_gathered"), cpu.read_rate("q4_1")) == (9e9, 14e9)


def test_measure_memory_bandwidth_is_positive() -> None:
    assert host.measure_memory_bandwidth(nbytes=1 << 20, repeats=1) > 0


@pytest.mark.parametrize(("flags", "simd"), [
    ("fpu sse2 avx avx2 fma f16c avx512f avx512bw avx512vl", "avx512"),
    # VNNI is a level of its own (runtime.cpu.simd_level): the batched kernels use it there.
    ("fpu sse2 avx avx2 fma f16c avx512f avx512bw avx512vl avx512_vnni", "avx512-vnni"),
    ("fpu sse2 avx avx2 fma f16c avx512f avx512_vnni avx_vnni", "avx2"),  # VNNI without BW / VL
    # AVX-512F alone is not what the AVX-512 kernels use (they need BW and VL too): the AVX2 code.
    ("fpu sse2 avx avx2 fma f16c avx512f", "avx2"),
    ("fpu sse2 avx avx2 fma f16c", "avx2"),
    ("fpu sse2 avx avx2", "sse"),  # no FMA / F16C: not even the AVX2 kernels
    ("fpu sse2", "sse"),
    ("", "sse"),
])
def test_host_simd(flags: str, simd: str) -> None:
    info = f"processor\t: 0\nmodel name\t: Test CPU 9000\nflags\t\t: {flags}\n"
    assert host.host_simd(info) == simd
    assert host.host_cpu_name(info) == "Test CPU 9000"


def test_target_from_a_path(tmp_path: Path) -> None:
    target = load_target(str(write(tmp_path, {**VALID, "description": "a test box", "pcie_bandwidth": 12e9})))
    assert target.name == "pc-x" and target.description == "a test box"
    assert target.gpu is not None and target.gpu.vram_bytes == 11 * 2**30
    assert target.pcie_bandwidth == 12e9 and target.cpu.mem_bandwidth == 38.4e9

    no_gpu = {key: value for key, value in VALID.items() if key not in ("gpu", "pcie_bandwidth")}
    target = load_target(str(write(tmp_path, no_gpu, "cpu-only.yaml")))
    assert target.gpu is None and target.pcie_bandwidth == 0


def test_error_names_the_file_and_the_field(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    write(tmp_path, {**VALID, "gpu": {**VALID["gpu"], "vram": "lots"}})
    with pytest.raises(PiccError) as e:
        load_target("pc-x.yaml")
    assert str(e.value) == "pc-x.yaml: gpu.vram: expected a size like 11GiB, got 'lots'"


def without(section: str, key: str) -> dict[str, object]:
    return {**VALID, section: {k: v for k, v in VALID[section].items() if k != key}}


def replaced(section: str, key: str, value: object) -> dict[str, object]:
    return {**VALID, section: {**VALID[section], key: value}}


GPU_FIELDS = "expected one of name, arch, vram, mem_bandwidth, kernel_overhead, sync_overhead"


@pytest.mark.parametrize(("data", "message"), [
    (replaced("gpu", "vrm", "11GiB"), f"gpu.vrm: unknown field ({GPU_FIELDS})"),
    ({**VALID, "vram": "11GiB"},
     "vram: unknown field (expected one of name, description, gpu, pcie_bandwidth, pcie_latency, cpu)"),
    (without("gpu", "vram"), "gpu.vram: missing, expected a size like 11GiB"),
    (without("cpu", "simd"), "cpu.simd: missing, expected one of avx512-vnni, avx512, avx2, sse"),
    (replaced("gpu", "vram", -5), "gpu.vram: expected a size like 11GiB, got -5"),
    (replaced("gpu", "vram", "0GB"), "gpu.vram: expected a size like 11GiB, got '0GB'"),
    (replaced("gpu", "arch", "turing"), "gpu.arch: expected a CUDA architecture like sm_75, got 'turing'"),
    (replaced("gpu", "arch", 75), "gpu.arch: expected a CUDA architecture like sm_75, got 75"),
    (replaced("gpu", "mem_bandwidth", "-616GB/s"),
     "gpu.mem_bandwidth: expected a positive bandwidth like 616GB/s, got '-616GB/s'"),
    (replaced("gpu", "mem_bandwidth", -616e9),
     "gpu.mem_bandwidth: expected a positive bandwidth like 616GB/s, got -616000000000.0"),
    (replaced("gpu", "mem_bandwidth", "616GB"),
     "gpu.mem_bandwidth: expected a positive bandwidth like 616GB/s, got '616GB'"),
    (replaced("cpu", "cores", "eight"), "cpu.cores: expected a positive integer, got 'eight'"),
    (replaced("cpu", "cores", True), "cpu.cores: expected a positive integer, got True"),
    (replaced("cpu", "cores", 0), "cpu.cores: expected a positive integer, got 0"),
    (replaced("cpu", "simd", "neon"), "cpu.simd: expected one of avx512-vnni, avx512, avx2, sse, got 'neon'"),
    (replaced("cpu", "name", 3), "cpu.name: expected a non-empty string, got 3"),
    (replaced("cpu", "kernel_rates", {"q5_k": "9GB/s"}),
     "cpu.kernel_rates.q5_k: unknown field (expected one of f32, f16, q8_0, q4_0, q4_1, q4_0_xi16, q4_1_xi16, "
     "q4_0_r8, q4_1_r8, q4_0_r8_xi16, q4_1_r8_xi16, q4_0_r8_xi8, q4_1_r8_xi8, q8_0_r8_xi8, "
     "f32_gathered, f16_gathered, q8_0_gathered, q4_0_gathered, q4_1_gathered, q4_0_gathered_xi16, q4_1_gathered_xi16)"),
    (replaced("cpu", "kernel_rates", {"q4_1": "fast"}),
     "cpu.kernel_rates.q4_1: expected a positive bandwidth like 14GB/s, got 'fast'"),
    (replaced("cpu", "kernel_rates", ["q4_1"]),
     "cpu.kernel_rates: expected a mapping of weight formats to bandwidths, got ['q4_1']"),
    ({**VALID, "name": ""}, "name: expected a non-empty string, got ''"),
    ({k: v for k, v in VALID.items() if k != "pcie_bandwidth"},
     "pcie_bandwidth: missing, expected a positive bandwidth like 12GB/s"),
    ({**VALID, "gpu": None}, "pcie_bandwidth: a target without a GPU has no PCIe link; remove the field"),
    ({**{k: v for k, v in VALID.items() if k != "pcie_bandwidth"}, "gpu": None, "pcie_latency": "10us"},
     "pcie_latency: a target without a GPU has no PCIe link; remove the field"),
    ({**VALID, "pcie_latency": "soon"}, "pcie_latency: expected a duration like 3us, got 'soon'"),
    (replaced("gpu", "kernel_overhead", "-3us"), "gpu.kernel_overhead: expected a duration like 3us, got '-3us'"),
    (replaced("gpu", "sync_overhead", "2 hours"), "gpu.sync_overhead: expected a duration like 3us, got '2 hours'"),
    ({**VALID, "gpu": "fast"}, "gpu: expected a mapping of GPU fields or null, got 'fast'"),
    ({k: v for k, v in VALID.items() if k != "cpu"}, "cpu: missing, expected a mapping of CPU fields or 'host'"),
    ({**VALID, "cpu": "guess"}, "cpu: expected a mapping of CPU fields or 'host', got 'guess'"),
    ([1, 2], "expected a mapping of target fields (name, description, gpu, pcie_bandwidth, pcie_latency, cpu), "
             "got list"),
])
def test_schema_errors(tmp_path: Path, data: object, message: str) -> None:
    path = write(tmp_path, data)
    with pytest.raises(PiccError) as e:
        load_target(str(path))
    assert str(e.value) == f"{path}: {message}"


def test_invalid_yaml(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("name: x\ngpu: [unclosed\n")
    with pytest.raises(PiccError, match=r"^.*broken\.yaml: not valid YAML at line \d+: .+$"):
        load_target(str(path))


def test_unknown_target_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(PiccError) as e:
        load_target("pc-mid")
    assert str(e.value) == "unknown target 'pc-mid': expected one of cpu, h100, pc-high, pc-low, or a path to a .yaml file"
    missing = str(tmp_path / "nope.yaml")
    with pytest.raises(PiccError) as e:
        load_target(missing)
    assert str(e.value) == f"{missing}: target file not found"


@pytest.mark.parametrize(("text", "size"), [
    ("11GB", 11_000_000_000),
    ("11GiB", 11 * 2**30),
    ("11000MB", 11_000_000_000),
    ("512MiB", 512 * 2**20),
    ("0.5GB", 500_000_000),
    ("0", 0),
    ("123456", 123_456),
    ("11 gib", 11 * 2**30),
    ("1.5kb", 1500),
    ("2KiB", 2048),
    ("1TB", 10**12),
    ("1TiB", 2**40),
    ("64B", 64),
    ("0.3KiB", 307),  # fractions of a byte round down
    (" 60MB ", 60_000_000),
])
def test_parse_size_accepts(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["lots", "", "GB", "-1GB", "11 G B", "11XB", "1.5", "11GB/s", "1,000", "0x10"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(PiccError) as e:
        parse_size(text, what="--vram")
    assert str(e.value) == (f"--vram {text!r}: expected a size such as 11GB, 11GiB, 11000MB, 512MiB, 0.5GB, "
                            "a plain byte count or 0 (KB/MB/GB/TB are powers of 1000, KiB/MiB/GiB/TiB powers of 1024)")


def test_vnni_is_a_level_of_its_own() -> None:
    from runtime.cpu import simd_level, vector_isa

    vnni = simd_level(["avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512vnni"])
    assert vnni == "avx512-vnni" and vector_isa(vnni) == "avx512" == vector_isa("avx512")
    assert simd_level(["avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl"]) == "avx512"
