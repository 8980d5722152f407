"""IdleWatch, the Session stream's idle limit: it cancels only a read that has lasted the limit, says so, and
withdraws its cancellation; between reads, or in a fresh read, it re-arms. Driven by calling its check directly with
the read's start set, so no test waits on the clock; the end-to-end close is test_service_trust's."""

import asyncio

import pytest

from tether.server.idle_watch import IdleWatch


def test_a_read_past_the_limit_is_cancelled_and_the_cancel_is_the_watchs():
    async def stream(started: asyncio.Event):
        watch = IdleWatch(120.0)
        try:
            watch.reading()
            watch.since -= 121.0  # this read began past the limit
            started.set()
            await asyncio.Event().wait()  # a client that sends nothing
        except asyncio.CancelledError:
            assert watch.expired()
            return asyncio.current_task().cancelling()  # 0: the watch withdrew its cancel
        finally:
            watch.close()

    async def main():
        started = asyncio.Event()
        task = asyncio.create_task(stream(started))
        await started.wait()
        task.get_coro().cr_frame.f_locals["watch"]._check()  # the timer, come due
        return await asyncio.wait_for(task, 30)  # the bound only ends a failure

    assert asyncio.run(main()) == 0


@pytest.mark.parametrize("reading", [False, True])
def test_between_reads_or_in_a_fresh_read_it_rearms_and_cancels_nothing(reading):
    async def main():
        watch = IdleWatch(120.0)
        if reading:
            watch.reading()
        before = watch.timer
        watch._check()
        assert not watch.fired and watch.timer is not before  # looked again later
        assert asyncio.current_task().cancelling() == 0
        assert watch.timer.when() == pytest.approx((watch.since or watch.loop.time()) + 120.0, abs=1.0)
        watch.close()
        assert watch.timer.cancelled()

    asyncio.run(main())


def test_a_cancellation_that_is_not_the_watchs_is_not_claimed():
    async def stream():
        watch = IdleWatch(120.0)
        try:
            watch.reading()
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            assert not watch.expired()
            raise
        finally:
            watch.close()

    async def main():
        task = asyncio.create_task(stream())
        await asyncio.sleep(0)
        task.cancel()  # the client went away
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
