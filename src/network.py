"""Whether a server can be reached at all, asked once: the clients of W&B and of the Hugging Face hub retry a
connection that fails for a minute or more before they say so (on a cluster's compute node without network, each
job of a sweep)."""

from __future__ import annotations

import errno
import socket
import urllib.error
import urllib.request

_NO_ROUTE = (errno.ENETUNREACH, errno.EHOSTUNREACH)


def unreachable(url: str, timeout: float = 10.0) -> str | None:
    """Why nothing answers at ``url`` (no address for its host, no route to it, a connection refused or timed
    out), from one HEAD request through the environment's proxies, without retries; None where anything answers,
    an error included, or the request fails otherwise: once connected (a server slow to answer), or a TLS problem,
    left to the client, which knows its certificates."""
    try:
        urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout).close()
    except urllib.error.HTTPError:
        return None  # an answer
    except urllib.error.URLError as e:  # raised while connecting
        reason = e.reason
        if isinstance(reason, (socket.gaierror, ConnectionError, TimeoutError)) or (
                isinstance(reason, OSError) and reason.errno in _NO_ROUTE):
            return str(reason) or type(reason).__name__
    except (OSError, ValueError):  # once connected (a slow answer), a malformed address: the client's to judge
        return None
    return None
