"""The fast lane's reading of one request, timed hot: ``python bench/lane_parse.py [--base REF]``.

``gateway/server/lane.py``'s ``parse`` on the head and body the openai SDK sends for a small chat
completion (its ``x-stainless-*`` headers included), in a loop, best of ``--repeat`` runs of
``--number`` calls; with ``--base REF`` the same for that ref's ``lane.py`` (loaded beside this
tree's, its imports from this tree), alternated. Hot figures: at low load each step costs several
times as much (``bench/timeline.py``), in proportion.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import timeit
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

BODY = b'{"messages":[{"role":"user","content":"Say hello in five words."}],"model":"m","max_tokens":32,"stream":true}'
HEAD = [
    "POST /v1/chat/completions HTTP/1.1", "Host: 127.0.0.1:8080", "Accept-Encoding: gzip, deflate",
    "Connection: keep-alive", "Accept: application/json", "Content-Type: application/json",
    "User-Agent: OpenAI/Python 1.99.9", "X-Stainless-Lang: python", "X-Stainless-Package-Version: 1.99.9",
    "X-Stainless-OS: Linux", "X-Stainless-Arch: x64", "X-Stainless-Runtime: CPython",
    "X-Stainless-Runtime-Version: 3.11.7", "Authorization: Bearer sk-test", "X-Stainless-Async: false",
    "x-stainless-retry-count: 0", "x-stainless-read-timeout: 600", f"Content-Length: {len(BODY)}",
]
REQUEST = ("\r\n".join(HEAD) + "\r\n\r\n").encode() + BODY
PATHS = {b"/v1/chat/completions": "/v1/chat/completions"}


def load(ref: str | None):
    if ref is None:
        from gateway.server import lane
        return lane
    src = subprocess.run(["git", "show", f"{ref}:gateway/server/lane.py"], cwd=REPO, check=True,
                         capture_output=True).stdout
    spec = importlib.util.spec_from_loader(f"lane_{ref}", loader=None)
    mod = importlib.util.module_from_spec(spec)
    exec(compile(src, f"{ref}:gateway/server/lane.py", "exec"), mod.__dict__)
    return mod


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", help="git ref whose lane.py is timed beside this tree's")
    ap.add_argument("--number", type=int, default=20000)
    ap.add_argument("--repeat", type=int, default=7)
    a = ap.parse_args()
    trees = [("this tree", load(None))] + ([(a.base, load(a.base))] if a.base else [])
    best = {name: float("inf") for name, _ in trees}
    for _ in range(a.repeat):
        for name, mod in trees:
            parsed = mod.parse(REQUEST, PATHS, 8190, 100, float("inf"))
            assert parsed is not None and parsed[2] == BODY, f"{name}: the lane did not take the request"
            t = timeit.timeit(lambda m=mod: m.parse(REQUEST, PATHS, 8190, 100, float("inf")), number=a.number)
            best[name] = min(best[name], t / a.number * 1e6)
    print(f"| lane.parse, {len(HEAD) - 1} header fields | µs per request (best of {a.repeat}) |\n|---|---:|")
    for name, us in best.items():
        print(f"| {name} | {us:.2f} |")


if __name__ == "__main__":
    main()
