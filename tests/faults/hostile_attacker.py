"""The hostile tenant's client as its own process (`python -m tests.faults.hostile_attacker URL KEY
KIND...`): another tenant is another client, so its requests are built, sent, timed out and parsed
outside the process that measures the victim's inter-token latency (in one event loop, each
abandoned bomb's timeout and each scoring answer's parse ran between the victim's token arrivals).
It prints "attacking", attacks until a line arrives on stdin, then prints one JSON Result per line."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
import threading

from tests.faults.client import Result
from tests.faults.hostile_tenant import attack_until


async def _main(base_url: str, key: str, kinds: tuple[str, ...]) -> list[Result]:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def wait_for_stop() -> None:
        sys.stdin.readline()
        loop.call_soon_threadsafe(stop.set)

    threading.Thread(target=wait_for_stop, daemon=True).start()
    attack = asyncio.create_task(attack_until(base_url, key, stop, kinds))
    await asyncio.sleep(0)  # its first requests are on their way
    print("attacking", flush=True)
    return await attack


def main(argv: list[str]) -> int:
    base_url, key, *kinds = argv
    results = asyncio.run(_main(base_url, key, tuple(kinds)))
    for r in results:
        print(json.dumps(dataclasses.asdict(r)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
