"""run_in_short_lived_thread: the result or the exception of work run on a thread that has ended."""

from __future__ import annotations

import asyncio
import threading

import pytest

from ferrylm.engine.short_lived_thread import run_in_short_lived_thread


def test_result_and_exception_come_back_from_a_thread_that_ended():
    async def run():
        thread = await run_in_short_lived_thread(threading.current_thread)
        assert thread is not threading.current_thread()
        thread.join(5)
        assert not thread.is_alive()

        def fail():
            raise KeyError("k")

        with pytest.raises(KeyError):
            await run_in_short_lived_thread(fail)

    asyncio.run(run())
