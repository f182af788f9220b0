"""``state.redis_url``, read once: which kind of Redis deployment, where, and as whom.

Forms (a password in the URL is percent-encoded; ``user:password@`` for an ACL user):

- ``redis://[[user]:password@]host[:port][/db]``, ``rediss://...`` (TLS), ``unix:///path[?db=N]``:
  one server (or a primary whose failover is someone else's business). Handed to redis-py as is,
  once its port and database number are checked as redis-py reads them.
- ``redis+sentinel://[[user]:password@]host[:port][,host[:port]...]/<service>[/<db>]`` and
  ``rediss+sentinel://...``: the Sentinels (port 26379 unless given) that know the primary
  called ``<service>``; the client asks them where it is and follows a failover.
- ``redis+cluster://[[user]:password@]host[:port][,host[:port]...]`` and ``rediss+cluster://...``:
  any reachable nodes of a Redis Cluster (port 6379 unless given); the client learns the rest.

Parsing has no dependency on the Redis client, so the config can validate a URL with it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal
from urllib.parse import parse_qsl, unquote, urlsplit

Mode = Literal["standalone", "sentinel", "cluster"]

PLAIN_SCHEMES = ("redis://", "rediss://", "unix://")
SENTINEL_SCHEMES = ("redis+sentinel://", "rediss+sentinel://")
CLUSTER_SCHEMES = ("redis+cluster://", "rediss+cluster://")
DEFAULT_PORT = {"sentinel": 26379, "cluster": 6379}

_HOST = re.compile(r"\A(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<name>[A-Za-z0-9._\-]+))(?::(?P<port>[0-9]{1,5}))?\Z")
_SERVICE = re.compile(r"\A[A-Za-z0-9._\-]{1,128}\Z")


@dataclass(frozen=True, slots=True)
class RedisTarget:
    mode: Mode
    url: str                                   # as given (standalone: what redis-py reads)
    tls: bool = False
    nodes: tuple[tuple[str, int], ...] = ()    # sentinels, or cluster startup nodes
    service: str | None = None                 # the primary's name the Sentinels know
    db: int = 0
    username: str | None = None
    password: str | None = None

    @property
    def redacted(self) -> str:
        """The URL without its credentials, for logs."""
        return _redact(self.url)


def redis_mode(url: str) -> Mode:
    if url.startswith(SENTINEL_SCHEMES):
        return "sentinel"
    if url.startswith(CLUSTER_SCHEMES):
        return "cluster"
    return "standalone"


def parse_redis_url(url: str) -> RedisTarget:
    """The deployment ``url`` names; ``ValueError`` says what is wrong with it."""
    if url.startswith(PLAIN_SCHEMES):
        _check_plain(url)
        return RedisTarget("standalone", url, tls=url.startswith("rediss://"))
    mode = redis_mode(url)
    if mode == "standalone":
        raise ValueError("must be a redis://, rediss://, unix://, redis+sentinel://, rediss+sentinel://, "
                         f"redis+cluster:// or rediss+cluster:// URL, got {_redact(url)!r}")
    scheme, _, rest = url.partition("://")
    if "?" in rest or "#" in rest:
        raise ValueError(f"{scheme}:// URLs take no query or fragment, got {_redact(url)!r}")
    userinfo, at, hostpart = rest.rpartition("@")
    username = password = None
    if at:
        user, colon, pw = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(pw) if colon else None
        if not colon:       # redis-py's reading of a lone userinfo: it is the password
            username, password = None, unquote(user) or None
    hosts, _, path = hostpart.partition("/")
    nodes = tuple(_node(h, DEFAULT_PORT[mode], url) for h in hosts.split(","))
    service, db = None, 0
    parts = path.split("/") if path else []
    if mode == "sentinel":
        if not parts or not parts[0]:
            raise ValueError(f"{scheme}:// needs the primary's service name: "
                             f"{scheme}://host:26379[,host:port...]/<service>[/<db>], got {_redact(url)!r}")
        service = unquote(parts[0])
        if not _SERVICE.match(service):
            raise ValueError(f"bad Sentinel service name {service!r} in {_redact(url)!r}")
        if len(parts) > 2 or (len(parts) == 2 and not parts[1].isdigit()):
            raise ValueError(f"after the service name only a database number may follow, got {_redact(url)!r}")
        db = int(parts[1]) if len(parts) == 2 else 0
    elif parts and any(parts):
        raise ValueError(f"a Redis Cluster has only database 0: no path after the nodes, got {_redact(url)!r}")
    return RedisTarget(mode, url, tls=scheme.startswith("rediss+"), nodes=nodes, service=service, db=db,
                       username=username, password=password)


def _check_plain(url: str) -> None:
    """What redis-py would refuse in a one-server URL when the gateway starts, as a ``ValueError``
    now: a port that is no number or out of range, a database (the path, or ``?db=``) that is no
    number (a path redis-py cannot read as one it drops, and uses database 0)."""
    try:
        parts = urlsplit(url)
        parts.port      # noqa: B018 (raises ValueError for a port that is not 0..65535)
    except ValueError as e:
        raise ValueError(f"{e}, in {_redact(url)!r}") from None
    if not url.startswith("unix://") and parts.path not in ("", "/") and not re.fullmatch(r"/[0-9]+", parts.path):
        raise ValueError(f"the path is a database number (/0, /1, ...), got {parts.path!r} in {_redact(url)!r}")
    for name, value in parse_qsl(parts.query):
        if name == "db" and not value.isdigit():
            raise ValueError(f"db must be a database number, got {value!r} in {_redact(url)!r}")


def _node(text: str, default_port: int, url: str) -> tuple[str, int]:
    m = _HOST.match(text)
    if m is None:
        raise ValueError(f"bad host:port {text!r} in {_redact(url)!r}")
    port = int(m["port"]) if m["port"] else default_port
    if not 0 < port < 65536:
        raise ValueError(f"bad port {port} in {_redact(url)!r}")
    return (m["v6"] or m["name"]), port


# a query's password (``?password=``, which the Redis client reads from redis://, rediss:// and
# unix:// URLs: a socket's password has nowhere else to go in its URL)
_QUERY_PASSWORD = re.compile(r"([?&](?:password|username)=)[^&#]*", re.IGNORECASE)


def _redact(url: str) -> str:
    """``url`` for a log line or an error: no user, no password, in its userinfo or its query."""
    url = _QUERY_PASSWORD.sub(r"\1***", url)
    if "@" not in url:
        return url
    scheme, _, rest = url.partition("://")
    return f"{scheme}://***@{rest.rpartition('@')[2]}"


def redact(url: str | None) -> str | None:
    """``url`` without its credentials, for a log line (None stays None)."""
    return url if url is None else _redact(url)
