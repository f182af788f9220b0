"""A small Chrome DevTools Protocol client: a headless Chromium (Debian's ``chromium``) driven over
its DevTools WebSocket with aiohttp, for the status page's browser tests and its screenshot.

``Browser.launch()`` starts the process (synchronously, so a module-scoped fixture can hold it)
and ``await browser.new_page()`` opens a tab. A ``Page`` records every console error, uncaught
exception and browser log error (failed loads, Content-Security-Policy violations) in
``page.problems``; ``wait_for(js)`` waits for a DOM condition inside the page, bounded in time.

The browser may only reach loopback: every host name but ``localhost`` resolves to nothing, and
its background services (updates, safe browsing, sync, metrics) are off.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--no-default-browser-check",
    "--disable-extensions", "--disable-background-networking", "--disable-component-update",
    "--disable-sync", "--disable-default-apps", "--disable-domain-reliability", "--no-pings",
    "--disable-client-side-phishing-detection", "--metrics-recording-only", "--mute-audio",
    "--disable-features=Translate,OptimizationHints,MediaRouter,AutofillServerCommunication",
    "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE localhost, EXCLUDE 127.0.0.1",
    "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0", "--hide-scrollbars",
    "--force-color-profile=srgb", "--lang=en-US", "--disable-dev-shm-usage",
)


# resolves with the condition's value once it is truthy; checked at once, on DOM changes, every 100 ms
WAIT_JS = """new Promise((resolve, reject) => {
  const test = () => { try { return (__CONDITION__); } catch (e) { return null; } };
  const first = test();
  if (first) { resolve(first); return; }
  let done = false;
  const finish = (f) => { if (!done) { done = true; obs.disconnect(); clearInterval(iv); clearTimeout(to); f(); } };
  const check = () => { const v = test(); if (v) finish(() => resolve(v)); };
  const obs = new MutationObserver(check);
  obs.observe(document, {subtree: true, childList: true, characterData: true, attributes: true});
  const iv = setInterval(check, 100);
  const to = setTimeout(() => finish(() => reject(new Error("timed out waiting for: " + __TEXT__))), __MS__);
})"""


def chromium_binary() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


def launch_for_test() -> Browser:
    """A launched ``Browser`` for a test: the test is skipped when no Chromium is installed, and
    fails instead under CI, where ``make test`` installs Debian's."""
    import pytest

    if chromium_binary() is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is not installed (make test installs Debian's chromium)")
        pytest.skip("chromium is not installed (make test installs Debian's chromium)")
    return Browser.launch()


class BrowserError(RuntimeError):
    pass


class Browser:
    def __init__(self, proc: subprocess.Popen, profile: str, port: int) -> None:
        self.proc = proc
        self.profile = profile
        self.port = port

    @classmethod
    def launch(cls, binary: str | None = None, width: int = 1280, height: int = 900,
               timeout: float = 30.0) -> Browser:
        binary = binary or chromium_binary()
        if binary is None:
            raise BrowserError("no chromium on PATH (Debian: apt-get install chromium)")
        profile = tempfile.mkdtemp(prefix="sy-chromium-")
        # its chatter goes to a file: a pipe nobody reads would stall the browser once full
        log = open(Path(profile) / "chromium.log", "wb")  # closed once the process has it
        try:
            proc = subprocess.Popen([binary, *FLAGS, f"--user-data-dir={profile}/data",
                                     f"--window-size={width},{height}", "about:blank"],
                                    stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
        finally:
            log.close()
        port_file = Path(profile) / "data" / "DevToolsActivePort"
        deadline = time.monotonic() + timeout
        while True:   # Chromium writes its DevTools port here once it listens
            if port_file.exists():
                lines = port_file.read_text().split()
                if lines and lines[0].isdigit():
                    return cls(proc, profile, int(lines[0]))
            if proc.poll() is not None:
                err = (Path(profile) / "chromium.log").read_text(errors="replace")
                shutil.rmtree(profile, ignore_errors=True)
                raise BrowserError(f"chromium exited with {proc.returncode}:\n{err[-2000:]}")
            if time.monotonic() > deadline:
                cls(proc, profile, 0).close()
                raise BrowserError(f"chromium did not open its DevTools port within {timeout} s")
            time.sleep(0.05)

    def close(self) -> None:
        """Stop the browser's process group (it was started in its own session) and remove its profile."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        shutil.rmtree(self.profile, ignore_errors=True)

    async def new_page(self, width: int = 1280, height: int = 900) -> Page:
        base = f"http://127.0.0.1:{self.port}"
        session = aiohttp.ClientSession()
        try:
            async with session.put(f"{base}/json/new?about:blank") as r:
                target = await r.json(content_type=None)
            ws = await session.ws_connect(target["webSocketDebuggerUrl"], max_msg_size=0)
        except BaseException:
            await session.close()
            raise
        page = Page(session, ws, base, target["id"])
        await page.start(width, height)
        return page


class Page:
    def __init__(self, session: aiohttp.ClientSession, ws: aiohttp.ClientWebSocketResponse, base: str,
                 target_id: str) -> None:
        self.session = session
        self.ws = ws
        self.base = base
        self.target_id = target_id
        self.problems: list[str] = []      # console errors, exceptions, browser log errors
        self.console: list[str] = []       # every console message, for failure reports
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self._loaded = asyncio.Event()
        self._reader = asyncio.create_task(self._read())

    async def start(self, width: int, height: int) -> None:
        for method in ("Runtime.enable", "Log.enable", "Page.enable"):
            await self.send(method)
        await self.send("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1,
                        mobile=False)

    async def _read(self) -> None:
        async for msg in self.ws:
            if msg.type != aiohttp.WSMsgType.TEXT:
                break
            data = json.loads(msg.data)
            if "id" in data:
                fut = self._pending.pop(data["id"], None)
                if fut is not None and not fut.done():
                    if "error" in data:
                        fut.set_exception(BrowserError(f"{data['error']}"))
                    else:
                        fut.set_result(data.get("result", {}))
            else:
                self._event(data.get("method", ""), data.get("params", {}))
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(BrowserError("DevTools connection closed"))

    def _event(self, method: str, p: dict[str, Any]) -> None:
        if method == "Runtime.consoleAPICalled":
            text = " ".join(str(a.get("value", a.get("description", ""))) for a in p.get("args", []))
            self.console.append(f"{p.get('type')}: {text}")
            if p.get("type") in ("error", "assert"):
                self.problems.append(f"console.{p.get('type')}: {text}")
        elif method == "Runtime.exceptionThrown":
            d = p.get("exceptionDetails", {})
            desc = d.get("exception", {}).get("description") or d.get("text")
            self.problems.append(f"uncaught exception: {desc} at {d.get('url')}:{d.get('lineNumber')}")
        elif method == "Log.entryAdded":
            e = p.get("entry", {})
            self.console.append(f"log {e.get('level')} ({e.get('source')}): {e.get('text')} {e.get('url', '')}")
            if e.get("level") == "error":
                self.problems.append(f"log error ({e.get('source')}): {e.get('text')} {e.get('url', '')}".strip())
        elif method == "Page.loadEventFired":
            self._loaded.set()

    async def send(self, method: str, timeout: float = 30.0, **params: Any) -> dict[str, Any]:
        i = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._pending[i] = fut
        await self.ws.send_str(json.dumps({"id": i, "method": method, "params": params}))
        async with asyncio.timeout(timeout):
            return await fut

    async def navigate(self, url: str, timeout: float = 15.0) -> None:
        self._loaded.clear()
        r = await self.send("Page.navigate", url=url)
        if r.get("errorText"):
            raise BrowserError(f"navigation to {url} failed: {r['errorText']}")
        async with asyncio.timeout(timeout):
            await self._loaded.wait()

    async def evaluate(self, expression: str, timeout: float = 30.0) -> Any:
        r = await self.send("Runtime.evaluate", timeout=timeout + 5, expression=expression, awaitPromise=True,
                            returnByValue=True)
        if "exceptionDetails" in r:
            d = r["exceptionDetails"]
            raise BrowserError(d.get("exception", {}).get("description") or d.get("text"))
        return r.get("result", {}).get("value")

    async def wait_for(self, condition: str, timeout: float = 15.0) -> Any:
        """Wait inside the page until the JS expression ``condition`` is truthy; return its value.
        Checked on every DOM change and at least every 100 ms; a BrowserError after ``timeout``."""
        js = (WAIT_JS.replace("__CONDITION__", condition).replace("__TEXT__", json.dumps(condition))
              .replace("__MS__", str(int(timeout * 1000))))
        try:
            return await self.evaluate(js, timeout=timeout + 5)
        except BrowserError as e:
            raise BrowserError(f"{e}\nconsole:\n" + "\n".join(self.console[-20:])) from None

    async def text(self, selector: str) -> str | None:
        return await self.evaluate(f"(document.querySelector({json.dumps(selector)}) || {{}}).textContent ?? null")

    async def screenshot(self, path: str | Path, width: int = 1280) -> bytes:
        """The whole page at ``width`` CSS pixels, as PNG."""
        height = await self.evaluate("Math.ceil(document.documentElement.scrollHeight)")
        await self.send("Emulation.setDeviceMetricsOverride", width=width, height=int(height), deviceScaleFactor=1,
                        mobile=False)
        r = await self.send("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        data = base64.b64decode(r["data"])
        Path(path).write_bytes(data)
        return data

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            async with self.session.get(f"{self.base}/json/close/{self.target_id}") as r:
                await r.read()
        await self.ws.close()
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._reader
        await self.session.close()
