"""`python -m ferrylm.model.cpu.build_kernels [variant ...]`: build the C++ kernels ahead of the first start.

`make setup` runs it, so `make serve` finds them built (each library takes ~20-40 s to compile on 2
cores, per instruction-set variant). Without arguments it builds the variant this CPU would load
(FERRYLM_CPU_ISA or the best supported); "all" builds every variant this CPU supports.
"""

from __future__ import annotations

import logging
import sys
import time

from ferrylm.model.attention.cpu_kernels import load_cpu_kernels
from ferrylm.model.cpu.cpu_isa import select_variant, this_cpu
from ferrylm.model.quant.kernels import load_quant_kernels


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cpu = this_cpu()
    names = argv or [select_variant(cpu).name]
    if names == ["all"]:
        names = [v.name for v in cpu.supported()]
    failed = 0
    for name in names:
        start = time.perf_counter()
        quant, attention = load_quant_kernels(name), load_cpu_kernels(name)
        ok = quant is not None and attention is not None
        failed += not ok
        print(f"{name}: {'built' if ok else 'FAILED'} in {time.perf_counter() - start:.1f} s "
              f"(CPU {cpu.model or cpu.arch}, best supported {cpu.supported()[-1].name})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
