#!/usr/bin/env python
"""Container healthcheck: exit 0 if ``GET URL`` answers 200 within the timeout, else 1.

Installed as ``/usr/local/bin/kairos-healthcheck`` in the Kairos image (``python:3.11-slim`` has
no curl or wget). Usage: ``kairos-healthcheck http://127.0.0.1:9100/health [timeout_s]``.
The ingress's ``/health`` is 200 only when it is connected to NATS and sees at least one routable
prefill and one routable decode node; the other services' ``/health`` (metrics server) is 200
when connected to NATS.
"""

import sys
import urllib.error
import urllib.request


def main(argv: list[str]) -> int:
    if not 2 <= len(argv) <= 3:
        print("usage: kairos-healthcheck URL [timeout_s]", file=sys.stderr)
        return 2
    url, timeout = argv[1], float(argv[2]) if len(argv) == 3 else 3.0
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return 0 if resp.status == 200 else 1
    except urllib.error.HTTPError as exc:
        print(f"{url}: HTTP {exc.code}: {exc.read(300).decode(errors='replace')}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"{url}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
