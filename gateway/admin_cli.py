"""``python -m gateway.admin_cli``: the admin API from a shell.

    python -m gateway.admin_cli [--url URL] [--token TOKEN] users list
    python -m gateway.admin_cli users create alice --rpm 60 --tpm 100000 [--max-concurrent 4]
    python -m gateway.admin_cli users get alice
    python -m gateway.admin_cli users update alice --tpm 50000      # change some limits (PATCH)
    python -m gateway.admin_cli users update alice --models llama-8b chat   # the models alice may use
    python -m gateway.admin_cli users update alice --all-models    # every model again
    python -m gateway.admin_cli users update alice --priority critical     # her admission class
    python -m gateway.admin_cli users set alice --rpm 10            # replace all limits (PUT)
    python -m gateway.admin_cli users delete alice
    python -m gateway.admin_cli keys create --user alice [--name laptop] [--key TEXT]
    python -m gateway.admin_cli keys list [--user alice]
    python -m gateway.admin_cli keys get ID | keys update ID [--user U] [--name N] | keys delete ID

``--url`` defaults to ``$SWITCHYARD_URL`` or http://127.0.0.1:8888; ``--token`` to
``$SWITCHYARD_ADMIN_TOKEN``. Answers are printed as JSON; an error answer prints its message on
stderr and exits 1. Standard library only, so it runs anywhere the gateway's source is.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, TextIO


def _request(url: str, token: str, method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url.rstrip("/") + path, data=data, method=method,
                                 headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            return e.code, json.loads(raw)
        except ValueError:
            return e.code, {"error": {"message": raw.decode("utf-8", "replace") or e.reason}}


def _limits(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {k: v for k, v in (("rpm", args.rpm), ("tpm", args.tpm),
                                             ("max_concurrent", args.max_concurrent)) if v is not None}
    if args.models is not None:
        out["models"] = args.models
    elif args.all_models:
        out["models"] = None
    if args.priority is not None:
        out["priority"] = None if args.priority == "default" else args.priority
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m gateway.admin_cli", description="Switchyard admin: users and API keys")
    p.add_argument("--url", default=os.environ.get("SWITCHYARD_URL", "http://127.0.0.1:8888"),
                   help="gateway base URL (default: $SWITCHYARD_URL or http://127.0.0.1:8888)")
    p.add_argument("--token", default=os.environ.get("SWITCHYARD_ADMIN_TOKEN"),
                   help="admin token (default: $SWITCHYARD_ADMIN_TOKEN)")
    what = p.add_subparsers(dest="what", required=True)

    users = what.add_parser("users", help="users and their limits").add_subparsers(dest="op", required=True)
    users.add_parser("list")
    for op in ("get", "delete"):
        users.add_parser(op).add_argument("name")
    for op, help_ in (("create", "a new user"), ("update", "change the given limits"),
                      ("set", "replace all limits (unset ones become 0: unlimited)")):
        sp = users.add_parser(op, help=help_)
        sp.add_argument("name")
        sp.add_argument("--rpm", type=int, help="requests per minute (0: unlimited)")
        sp.add_argument("--tpm", type=int, help="tokens per minute (0: unlimited)")
        sp.add_argument("--max-concurrent", type=int, help="requests in flight at once (0: unlimited)")
        models = sp.add_mutually_exclusive_group()
        models.add_argument("--models", nargs="+", metavar="NAME",
                            help="the models (or aliases, LoRA adapters) the user may ask for, by name")
        models.add_argument("--all-models", action="store_true", help="the user may ask for every model (no list)")
        sp.add_argument("--priority", choices=("critical", "standard", "sheddable", "default"),
                        help="the admission class of the user's requests (default: no class of its own, the "
                             "default user's or admission.default_priority)")

    keys = what.add_parser("keys", help="API keys").add_subparsers(dest="op", required=True)
    keys.add_parser("list").add_argument("--user")
    for op in ("get", "delete"):
        keys.add_parser(op).add_argument("id")
    sp = keys.add_parser("create", help="prints the key once")
    sp.add_argument("--user", required=True,
                    help="the key's user; it needs no user record (without one, limits.default_user applies)")
    sp.add_argument("--name")
    sp.add_argument("--key", help="use this text as the key instead of a generated one")
    sp = keys.add_parser("update")
    sp.add_argument("id")
    sp.add_argument("--user")
    sp.add_argument("--name")
    return p


def _call(args: argparse.Namespace) -> tuple[str, str, dict[str, Any] | None]:
    q = urllib.parse.quote
    if args.what == "users":
        if args.op == "list":
            return "GET", "/admin/users", None
        if args.op == "create":
            return "POST", "/admin/users", {"name": args.name, **_limits(args)}
        path = f"/admin/users/{q(args.name, safe='')}"
        if args.op in ("update", "set"):
            return ("PATCH" if args.op == "update" else "PUT"), path, _limits(args)
        return ("GET" if args.op == "get" else "DELETE"), path, None
    if args.op == "list":
        return "GET", "/admin/keys" + (f"?user={q(args.user, safe='')}" if args.user else ""), None
    if args.op == "create":
        body = {"user": args.user, **({"name": args.name} if args.name is not None else {}),
                **({"key": args.key} if args.key is not None else {})}
        return "POST", "/admin/keys", body
    path = f"/admin/keys/{q(args.id, safe='')}"
    if args.op == "update":
        return "PATCH", path, {k: v for k, v in (("user", args.user), ("name", args.name)) if v is not None}
    return ("GET" if args.op == "get" else "DELETE"), path, None


def main(argv: list[str] | None = None, out: TextIO | None = None, err: TextIO | None = None) -> int:
    out, err = out or sys.stdout, err or sys.stderr
    args = _parser().parse_args(argv)
    if not args.token:
        print("admin_cli: no admin token (--token or $SWITCHYARD_ADMIN_TOKEN)", file=err)
        return 2
    method, path, body = _call(args)
    try:
        status, data = _request(args.url, args.token, method, path, body)
    except (urllib.error.URLError, OSError) as e:
        print(f"admin_cli: cannot reach {args.url}: {getattr(e, 'reason', e)}", file=err)
        return 1
    if status >= 400:
        msg = data.get("error", {}).get("message") if isinstance(data, dict) else None
        print(f"admin_cli: {status}: {msg or data}", file=err)
        return 1
    print(json.dumps(data, indent=2, sort_keys=True), file=out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
