"""The engine's static shape choices: few compiled shapes, bounded padding."""

from __future__ import annotations

from paxkv.scheduler import _bucket, _fine_bucket


def test_fine_bucket_covers_the_longest_row_and_wastes_at_most_a_third():
    seen = set()
    for n in range(1, 2049):
        w = _fine_bucket(n, 64, 2048)
        assert w >= n and w % 16 == 0
        if n > 64:
            assert (w - n) / w < 1 / 3  # a power-of-two window wastes up to 1/2
        seen.add(w)
    # Two shapes per doubling: 64, 96, 128, 192, ..., 1536, 2048.
    assert sorted(seen) == [64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048]
    assert _fine_bucket(5000, 64, 2048) == 2048 and _fine_bucket(1, 64, 100) == 64


def test_token_buckets_are_powers_of_two():
    assert [_bucket(n, 16, 512) for n in (1, 16, 17, 300, 513)] == [16, 16, 32, 512, 512]
