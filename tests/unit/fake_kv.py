"""An in-memory stand-in for the part of nats-py's JetStream ``KeyValue`` that the execution claims
use (``create``, ``get``, ``delete``), with the behaviour of nats-py 2 (``nats/js/kv.py``) against
nats-server:

* a revision is the bucket stream's sequence number: one counter for every key, each write
  (value or delete marker) takes the next one, starting at 1;
* ``create`` stores a key that does not exist or whose newest entry is a delete marker, and raises
  ``KeyWrongLastSequenceError`` when the key holds a value;
* ``get`` returns the newest entry, and raises ``KeyNotFoundError`` for a key never written and for
  a deleted one (nats-py turns its ``KeyDeletedError`` into ``KeyNotFoundError``);
* ``delete(key, last=rev)`` writes a delete marker only while the key's newest revision is ``rev``;
  otherwise nats-server refuses the publish and nats-py raises ``APIError`` with err_code 10071
  (``delete`` does not translate it into ``KeyWrongLastSequenceError``, ``update`` does).

``faults[op]``: what the next calls of ``op`` meet, first in first out — an exception is raised
(the bus did not answer), a callable is called and the operation then runs (something that happens
on the bus just before it) unless the callable raises (e.g. the write stored, its answer lost).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable

import nats.js.errors
from nats.js.kv import KeyValue


class FakeKV:
    def __init__(self, bucket: str = "kairos_requests") -> None:
        self.bucket = bucket
        self.seq = 0  #: the stream's last sequence number
        self.entries: dict[str, tuple[bytes | None, int]] = {}  #: key -> (value, None: deleted; revision)
        self.faults: dict[str, list[BaseException | Callable[[], Any]]] = defaultdict(list)
        self.calls: list[tuple[str, str]] = []  #: (operation, key), in order

    def _enter(self, op: str, key: str) -> None:
        self.calls.append((op, key))
        if self.faults[op]:
            f = self.faults[op].pop(0)
            if isinstance(f, BaseException):
                raise f
            f()

    def _write(self, key: str, value: bytes | None) -> int:
        self.seq += 1
        self.entries[key] = (value, self.seq)
        return self.seq

    def put_raw(self, key: str, value: bytes) -> int:
        """Store ``value`` as another writer would (no call recorded); returns its revision."""
        return self._write(key, value)

    def value(self, key: str) -> bytes | None:
        """The newest value of ``key`` (None: never written or deleted), read without a call."""
        return self.entries.get(key, (None, 0))[0]

    async def create(self, key: str, value: bytes) -> int:
        self._enter("create", key)
        held = self.entries.get(key)
        if held is not None and held[0] is not None:
            raise nats.js.errors.KeyWrongLastSequenceError(description=f"wrong last sequence: {held[1]}")
        return self._write(key, value)

    async def get(self, key: str) -> KeyValue.Entry:
        self._enter("get", key)
        held = self.entries.get(key)
        if held is None or held[0] is None:
            raise nats.js.errors.KeyNotFoundError
        return KeyValue.Entry(bucket=self.bucket, key=key, value=held[0], revision=held[1], delta=None,
                              created=None, operation=None)

    async def delete(self, key: str, last: int | None = None) -> bool:
        self._enter("delete", key)
        newest = self.entries.get(key, (None, 0))[1]
        if last and last > 0 and last != newest:
            raise nats.js.errors.APIError(code=400, err_code=10071,
                                          description=f"wrong last sequence: {newest}")
        self._write(key, None)
        return True
