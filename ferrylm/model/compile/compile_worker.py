"""Compiling the decode graphs in a child process, so that serving never waits on the GIL for it.

Tracing and lowering a graph is Python that holds the GIL for most of its minutes; on a thread of
the serving process it made every eager step wait ~5 ms per op for the GIL (a 4-token warm-up or a
/ready probe took 7-12 s on a 2-core AVX2 machine instead of 0.3 s). The child builds the same
runner from the same EngineConfig, compiles every batch-size bucket into the disk cache
(compile_cache.py) at a lower CPU priority, and exits; the serving process then loads the graphs
from the cache, which takes about a second. The cost is a second copy of the weights in memory
while the child runs, and only on a cold cache (a warm one has nothing to compile).

    python -m ferrylm.model.compile.compile_worker   # the EngineConfig pickled on stdin
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import subprocess
import sys
import threading
import time

from ferrylm.config import EngineConfig
from ferrylm.model.background_priority import background_python, yield_cpu_to_serving

log = logging.getLogger("ferrylm.compile")


def compile_in_child(config: EngineConfig) -> bool:
    """Run the compile worker for `config` and wait for it; True when it compiled (or loaded) every
    graph into the disk cache. Waiting releases the GIL."""
    start = time.monotonic()
    proc = subprocess.Popen(background_python("ferrylm.model.compile.compile_worker"), stdin=subprocess.PIPE)
    log.info("compiling the decode graphs in a child process (pid %d, below serving threads); steps run eagerly "
             "meanwhile", proc.pid)
    assert proc.stdin is not None
    # the child needs the model and the KV pool's shape only: no host blocks, and not the disk tier's
    # directory, which one process holds at a time
    cache = dataclasses.replace(config.cache, swap_space=0.0, kv_offload_cpu_gib=0.0, kv_offload_disk_path=None)
    try:
        proc.stdin.write(pickle.dumps((dataclasses.replace(config, cache=cache), os.getpid())))
        proc.stdin.close()
    except BrokenPipeError:
        pass  # it died at start: its exit code says so
    code = proc.wait()
    if code != 0:
        log.warning("the compile worker exited with code %d after %.0f s", code, time.monotonic() - start)
    return code == 0


def _exit_with_parent(parent: int) -> None:
    """A worker whose server is gone has no one to compile for: exit (and so close inductor's pool)."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(3)


def main() -> None:
    config, parent = pickle.loads(sys.stdin.buffer.read())
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s compile-worker %(name)s: %(message)s")
    yield_cpu_to_serving()  # serving traffic first: the compile is a later speed-up, not a gate
    threading.Thread(target=_exit_with_parent, args=(parent,), name="parent-watch", daemon=True).start()
    from ferrylm.model.parallel.tp_worker import build_runner

    runner, _, _ = build_runner(config, compile_in_child=False)
    step = runner.wait_compiled()
    from torch._inductor.async_compile import shutdown_compile_workers

    shutdown_compile_workers()
    os._exit(0 if step is not None else 1)  # no teardown of the model and inductor's pool


if __name__ == "__main__":
    main()
