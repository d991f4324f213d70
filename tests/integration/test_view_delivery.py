"""Each cluster view is sent once to its readers (issue 34): every view goes out on ``kairos.view``;
the view bucket, read once by a service that starts, gets one at most once a second. The truth is
what a separate connection sees on the two subjects of a real nats-server."""

from __future__ import annotations

import nats

from kairos.contracts import subjects as S
from kairos.services.state_aggregator.service import VIEW_BUCKET_PERIOD_S
from tests.integration.conftest import stack, wait_until


async def test_views_go_out_on_the_subject_and_the_bucket_gets_one_a_second(nats_url):
    async with stack(nats_url, prefill=1, decode=1, dispatchers=1, period_ms=50.0) as st:
        nc = await nats.connect(nats_url)
        try:
            seen = {"subject": 0, "bucket": 0}

            async def on_subject(_msg) -> None:
                seen["subject"] += 1

            async def on_bucket(_msg) -> None:  # a put is a publish on the key's subject (nobody deletes it)
                seen["bucket"] += 1

            await nc.subscribe(S.VIEW_SUBJECT, cb=on_subject)
            await nc.subscribe(f"$KV.{S.VIEW_BUCKET}.{S.VIEW_KEY}", cb=on_bucket)
            await nc.flush()
            await wait_until(lambda: seen["subject"] >= 50, 20, "50 views on kairos.view")
            bucket, views = seen["bucket"], seen["subject"]
            window_s = views * 0.05  # the stack's period
            assert 1 <= bucket <= window_s / VIEW_BUCKET_PERIOD_S + 2, seen
            # the bucket's last view is a recent one: what a service that starts now reads first
            e = await (await nc.jetstream().key_value(S.VIEW_BUCKET)).get(S.VIEW_KEY)
            assert e.value and st.ingress.readiness.ready is not None
        finally:
            await nc.close()


async def test_last_view_hands_over_the_stored_view_and_survives_none():
    from kairos.runtime.messaging import last_view

    class Entry:
        value = b'{"seq": 3}'

    class Bucket:
        def __init__(self, result) -> None:
            self.result = result

        async def get(self, key):
            assert key == S.VIEW_KEY
            if isinstance(self.result, Exception):
                raise self.result
            return self.result

    class Log:
        def debug(self, *a, **k) -> None:
            pass

    got: list[bytes] = []
    await last_view(Bucket(Entry()), got.append, Log())
    await last_view(Bucket(nats.js.errors.KeyNotFoundError()), got.append, Log())
    await last_view(Bucket(TimeoutError()), got.append, Log())
    assert got == [b'{"seq": 3}']
