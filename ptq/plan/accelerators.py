"""Accelerators `ptq plan` knows: memory, bandwidth, dense matmul rates, fp8 support.

Every figure is the vendor's peak for one GPU, **dense** (NVIDIA's datasheets print the
2:4-sparse figure first; the dense one is half of it). Memory is the datasheet's "GB",
counted here as 10^9 bytes: slightly less than the HBM really holds (an "80 GB" H100
shows 81,559 MiB = 85.5 * 10^9 bytes in nvidia-smi), so plans err on the safe side.
Bandwidth in 10^9 bytes/s, matmul rates in 10^12 operations/s.

Sources (read 2026):
- H100 SXM / PCIe: NVIDIA H100 Tensor Core GPU datasheet, https://www.nvidia.com/en-us/data-center/h100/
- H200: NVIDIA H200 datasheet, https://www.nvidia.com/en-us/data-center/h200/ (H100 SXM's compute, 141 GB, 4.8 TB/s)
- B200: NVIDIA DGX B200 / HGX B200 datasheets, https://www.nvidia.com/en-us/data-center/hgx/ (1,440 GB
  and 64 TB/s per 8 GPUs; 1,000 W HGX rates as tabulated at https://glennklockwood.com/garden/processors/B200)
- A100 40 / 80 GB (SXM): NVIDIA A100 datasheet, https://www.nvidia.com/en-us/data-center/a100/
  (Ampere has no fp8 tensor cores)
- L40S: https://www.nvidia.com/en-us/data-center/l40s/
- L4: https://www.nvidia.com/en-us/data-center/l4/
- RTX 4090: NVIDIA Ada Lovelace GPU architecture whitepaper, appendix table (GeForce rates with
  FP32 accumulation, which inference kernels use), https://images.nvidia.com/aem-dam/Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf
- MI300X: AMD Instinct MI300X datasheet, https://www.amd.com/en/products/accelerators/instinct/mi300/mi300x.html
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

from ptq.errors import PtqError


@dataclass(frozen=True)
class Accelerator:
    name: str
    memory_gb: float  # 10^9 bytes
    bandwidth_gbs: float  # memory bandwidth, 10^9 bytes/s
    bf16_tflops: float  # dense bf16 tensor-core rate (fp32 accumulation)
    fp8_tflops: float | None  # dense fp8 rate; None: no fp8 tensor cores
    int8_tops: float | None  # dense int8 rate
    source: str = ""

    @property
    def fp8(self) -> bool:
        return self.fp8_tflops is not None

    def rate(self, kind: str) -> float | None:
        """Tensor-core operations per second for matmuls in `kind` (bf16, fp8, int8), or None."""
        tera = {"bf16": self.bf16_tflops, "fp8": self.fp8_tflops, "int8": self.int8_tops}[kind]
        return None if tera is None else tera * 1e12

    def to_dict(self) -> dict:
        return asdict(self)


_H100 = "NVIDIA H100 datasheet"
ACCELERATORS: dict[str, Accelerator] = {a.name: a for a in (
    Accelerator("H100-SXM", 80, 3350, 989.5, 1979, 1979, _H100),
    Accelerator("H100-PCIe", 80, 2000, 756.5, 1513, 1513, _H100),
    Accelerator("H200", 141, 4800, 989.5, 1979, 1979, "NVIDIA H200 datasheet"),
    Accelerator("B200", 180, 8000, 2250, 4500, 4500, "NVIDIA HGX/DGX B200 datasheets"),
    Accelerator("A100-80GB", 80, 2039, 312, None, 624, "NVIDIA A100 datasheet"),
    Accelerator("A100-40GB", 40, 1555, 312, None, 624, "NVIDIA A100 datasheet"),
    Accelerator("L40S", 48, 864, 362, 733, 733, "NVIDIA L40S datasheet"),
    Accelerator("L4", 24, 300, 121, 242.5, 242.5, "NVIDIA L4 datasheet"),
    Accelerator("RTX-4090", 24, 1008, 165.2, 330.3, 660.6, "NVIDIA Ada architecture whitepaper"),
    Accelerator("MI300X", 192, 5300, 1307.4, 2614.9, 2614.9, "AMD MI300X datasheet"),
)}
ALIASES = {"H100": "H100-SXM", "A100": "A100-80GB", "4090": "RTX-4090"}


def _key(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def accelerator(name: str) -> Accelerator:
    """The bundled accelerator called `name` (case, spaces, dashes ignored: 'h100 sxm', 'H100_SXM')."""
    wanted = _key(name)
    for alias, target in ALIASES.items():
        if _key(alias) == wanted:
            return ACCELERATORS[target]
    for key, acc in ACCELERATORS.items():
        if _key(key) == wanted:
            return acc
    raise PtqError(f"unknown --gpu '{name[:40]}'; choose one of {', '.join(ACCELERATORS)} "
                   "(or give --memory-gb, --bandwidth-gbs and --tflops for another)")


def custom(memory_gb: float, bandwidth_gbs: float, tflops: float, *, fp8: bool = False) -> Accelerator:
    """An accelerator described by its numbers: int8 (and fp8 with fp8=True) at twice the bf16 rate."""
    for what, value in (("--memory-gb", memory_gb), ("--bandwidth-gbs", bandwidth_gbs), ("--tflops", tflops)):
        if not value > 0:
            raise PtqError(f"{what} is {value}; give a positive number")
    return Accelerator("custom", memory_gb, bandwidth_gbs, tflops, 2 * tflops if fp8 else None, 2 * tflops,
                       "given on the command line (8-bit rates taken as 2x bf16)")
