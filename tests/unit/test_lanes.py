"""Claim buckets (kairos/runtime/lanes.py): one per NATS member, bucket i placed on member i."""

from __future__ import annotations

import pytest

from kairos.contracts import subjects as S
from kairos.runtime.envconfig import ServiceConfig
from kairos.runtime.lanes import claims_bucket_config, lane_count


def test_claim_bucket_names_and_placement():
    one = claims_bucket_config(0, 1)
    assert one.placement is None and one.num_replicas == 1
    claims = claims_bucket_config(1, 3)
    assert (claims.name, claims.subjects, claims.placement.tags, claims.num_replicas, claims.max_msgs_per_subject,
            claims.allow_direct) == ("KV_kairos_claims_1", ["$KV.kairos_claims_1.>"], ["kairos-lane:1"], 1, 1, True)
    with pytest.raises(S.SubjectError):
        S.claims_bucket(S.MAX_LANES)


@pytest.mark.parametrize("urls, replicas, lanes", [
    ("nats://a:4222", 0, 1), ("nats://a:4222,nats://b:4222,nats://c:4222", 0, 3), ("nats://a:4222", 3, 3),
    (",".join(f"nats://h{i}:4222" for i in range(7)), 0, 5),
])
def test_one_claim_bucket_per_member(urls, replicas, lanes):
    assert lane_count(ServiceConfig(nats_url=urls, nats_replicas=replicas)) == lanes
