"""A worker whose loop ends while a sibling is connected to it (a failed start, a stop) cancels the
task answering that sibling. On Python 3.11 asyncio's stream server then asks the cancelled task for
its exception from a callback, which prints "Exception in callback" and a traceback to stderr unless
the answering task ends on its own."""
import asyncio

from gateway.server.siblings import Siblings
from gateway.server.workers import WorkerInfo


async def _nothing(kind: str) -> bytes:
    return b""


def test_a_cancelled_answer_to_a_sibling_reports_no_error_to_the_loop(tmp_path):
    errors: list[dict] = []

    async def main() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: errors.append(ctx))
        siblings = Siblings(WorkerInfo(index=0, count=2, run_dir=str(tmp_path)), _nothing)
        await siblings.start()
        reader, writer = await asyncio.open_unix_connection(siblings.path)   # says nothing yet
        for _ in range(20):
            serving = [t for t in asyncio.all_tasks() if "_serve" in repr(t.get_coro())]
            if serving:
                break
            await asyncio.sleep(0.01)
        assert serving, "the sibling socket never started answering the connection"
        for t in serving:
            t.cancel()
        await asyncio.gather(*serving, return_exceptions=True)
        for _ in range(5):                       # the server's done callbacks run on later turns
            await asyncio.sleep(0)
        writer.close()
        await siblings.stop()

    asyncio.run(main())
    assert errors == []
