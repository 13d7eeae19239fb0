import asyncio


async def test_async_tests_run_under_a_named_loop() -> None:
    loop = asyncio.get_running_loop()
    assert type(loop).__module__.split(".")[0] in {"asyncio", "uvloop"}
