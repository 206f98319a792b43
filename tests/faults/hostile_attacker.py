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


def lowest_session_priority() -> None:
    """Under Linux's autogroup (on here, and on most desktops) each session is one scheduling group,
    and groups share the CPU before niceness applies inside them: at nice +19 in the measuring
    client's session this process could still take a core from the server's decode step as that
    whole session's share. It runs in its own session (AttackerProcess), whose group this lowers to
    nice +19 too (no measurable change in the scenario: bench/RESULTS.md, "M3.2 hostile tenant:
    grammar workers forked from a ready process")."""
    try:
        with open("/proc/self/autogroup", "w") as group:
            group.write("19")
    except OSError:
        pass  # no autogroup here: niceness alone orders it


lowest_session_priority()  # before the imports below, which take a core for a while

from tests.faults.client import Result  # noqa: E402
from tests.faults.hostile_tenant import attack_until  # noqa: E402


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
