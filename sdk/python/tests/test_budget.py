"""The publish in-flight byte budget: bounded, first come first served, never lost."""

from __future__ import annotations

import asyncio

from conftest import run

from felix_client._transport import Budget


def test_budget_waits_in_order_and_clamps() -> None:
    """Publishers wait once the budget is spent and are served in arrival order as bytes come
    back; a publish larger than the budget takes all of it; a cancelled wait loses nothing."""

    async def ordered() -> None:
        budget = Budget(100)
        assert await budget.acquire(60) == 60
        order: list[str] = []

        async def take(name: str, amount: int) -> int:
            taken = await budget.acquire(amount)
            order.append(name)
            return taken

        big = asyncio.ensure_future(take("big", 1000))
        small = asyncio.ensure_future(take("small", 10))
        cancelled = asyncio.ensure_future(take("cancelled", 50))
        await asyncio.sleep(0)
        # 40 left: not enough for the big one (clamped to 100), and the small one queues
        # behind it rather than overtaking.
        assert order == []
        cancelled.cancel()
        budget.release(60)
        assert await big == 100
        assert order == ["big"]
        budget.release(100)
        assert await small == 10
        assert budget.available == 90
        assert cancelled.cancelled()

    run(ordered())
