"""How a store tier lays page groups out for its batch calls
(`hicache.chain.jobs.group_pieces`): fewer, larger pieces move faster, so a group in
consecutive slots is one piece where it can be."""

from __future__ import annotations

from hicache.chain.jobs import group_pieces

BACK_TO_BACK = (1000, 100, 100)  # slot s at 1000 + 100 s, pages of 100 bytes
SPACED = (1000, 128, 100)  # rows 128 bytes apart (a pool with padding): never merged


def test_one_run_of_slots_is_a_piece_per_group():
    pieces = group_pieces(BACK_TO_BACK, 4, list(range(8, 16)))
    assert pieces.ptrs == [[1800], [2200]]
    assert pieces.sizes == [[400], [400]]
    assert pieces.span == (1800, 2600)


def test_a_group_out_of_order_is_a_piece_per_page_and_the_others_stay_whole():
    pieces = group_pieces(BACK_TO_BACK, 4, [3, 4, 5, 6, 10, 9, 8, 7])
    assert pieces.ptrs == [[1300], [2000, 1900, 1800, 1700]]
    assert pieces.sizes == [[400], [100, 100, 100, 100]]
    assert pieces.span == (1300, 2100)


def test_rows_that_are_not_back_to_back_are_never_merged():
    pieces = group_pieces(SPACED, 2, [0, 1, 2, 3])
    assert pieces.ptrs == [[1000, 1128], [1256, 1384]]
    assert pieces.sizes == [[100, 100], [100, 100]]
    assert pieces.span == (1000, 1484)


def test_no_slots_no_pieces():
    pieces = group_pieces(BACK_TO_BACK, 4, [])
    assert (pieces.ptrs, pieces.sizes, pieces.span) == ([], [], None)


# pages of several segments (an engine's layer-first pool: a row of each per page)
TWO = [(1000, 100, 100), (5000, 64, 48)]  # back to back; spaced


def test_segments_of_a_run_of_slots_are_a_piece_each_where_rows_lie_back_to_back():
    from hicache.chain.jobs import segmented_pieces

    pieces = segmented_pieces(TWO, 2, [4, 5, 7])
    assert pieces.ptrs == [[1400, 5256, 5320], [1700, 5448]]
    assert pieces.sizes == [[200, 48, 48], [100, 48]]
    assert pieces.span == (1400, 5496)
    assert (segmented_pieces(TWO, 2, []).ptrs, segmented_pieces(TWO, 2, []).span) == ([], None)
