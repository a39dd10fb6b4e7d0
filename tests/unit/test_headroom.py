"""The local bound from D's headroom (turns/reuse/headroom.py, issue 36)."""

from __future__ import annotations

from gateway.engines.dataplane import DataPlane
from gateway.engines.engine import Engine
from gateway.turns.reuse.headroom import FLOOR_TOKENS, for_decode, local_bound

RATE = 50_000.0          # tokens/s: an H200's prefill of the bench model


def test_an_idle_d_gets_the_whole_cap():
    assert local_bound(8192, 0.02, RATE, streams=0, waiting=0, in_flight=0).bound == 8192


def test_streams_bound_it_by_the_itl_budget_at_the_learned_rate():
    room = local_bound(8192, 0.02, RATE, streams=12, waiting=0, in_flight=0)
    assert room.budget_tokens == 1000 and room.bound == 1000


def test_local_prefills_in_flight_use_up_the_budget_down_to_the_floor():
    assert local_bound(8192, 0.02, RATE, streams=3, waiting=0, in_flight=600).bound == 400
    assert local_bound(8192, 0.02, RATE, streams=3, waiting=0, in_flight=5000).bound == FLOOR_TOKENS


def test_a_queueing_d_gets_the_floor_and_no_rate_means_the_floor():
    assert local_bound(8192, 0.02, RATE, streams=0, waiting=2, in_flight=0).bound == FLOOR_TOKENS
    assert local_bound(8192, 0.02, None, streams=4, waiting=0, in_flight=0).bound == FLOOR_TOKENS


def test_the_cap_bounds_everything_and_zero_is_off():
    assert local_bound(128, 0.02, RATE, streams=4, waiting=0, in_flight=0).bound == 128
    assert local_bound(0, 0.02, RATE, streams=0, waiting=0, in_flight=0).bound == 0


def test_for_decode_reads_the_engine_and_its_last_scrape():
    d = Engine("http://d", "decode", outstanding_requests=2, local_prefill_tokens=300)
    d.data_plane = DataPlane(requests_running=9.0, requests_waiting=0.0)
    room = for_decode(d, 8192, 20.0, RATE)
    assert (room.streams, room.in_flight, room.bound) == (9, 300, 700)
    assert set(room.fields()) == {"local_bound", "d_streams", "d_decoding", "d_waiting", "d_local_in_flight",
                                  "local_budget_tokens"}


def test_streams_still_waiting_for_their_first_token_slow_nothing():
    """A burst of first turns: D runs 8 requests, none decoding yet, so a prefill costs no stream its ITL; the
    path choice weighs D's local prefills in flight instead (cost.choose_path). One stream decoding: the budget."""
    assert local_bound(8192, 0.02, RATE, streams=8, decoding=0, waiting=0, in_flight=9000).bound == 8192
    assert local_bound(8192, 0.02, RATE, streams=8, decoding=1, waiting=0, in_flight=9000).bound == FLOOR_TOKENS


def test_for_decode_counts_d_s_other_requests_as_decoding():
    """This gateway's streams past their first token, and whatever D runs beyond this gateway's (another worker's
    or replica's): nothing says those are not decoding."""
    d = Engine("http://d", "decode", outstanding_requests=3, decoding_streams=1, local_prefill_tokens=2000)
    assert for_decode(d, 8192, 20.0, RATE).decoding == 1
    d.data_plane = DataPlane(requests_running=5.0, requests_waiting=0.0)
    assert for_decode(d, 8192, 20.0, RATE).decoding == 3
    d.decoding_streams = 0
    d.data_plane = DataPlane(requests_running=3.0, requests_waiting=0.0)
    assert for_decode(d, 8192, 20.0, RATE).bound == 8192


def test_requests_waiting_for_p_s_kv_are_not_d_s_queue():
    """vLLM counts a P-path turn waiting for its KV on D as waiting ('deferred'): that is no queue for room, and
    taking it for one sent the agent workload's later turns the P path, each making the next look queued (H200)."""
    d = Engine("http://d", "decode", outstanding_requests=2, local_prefill_tokens=300)
    d.data_plane = DataPlane(requests_running=9.0, requests_waiting=2.0, requests_deferred=2.0)
    assert for_decode(d, 8192, 20.0, RATE).bound == 700
    d.data_plane = DataPlane(requests_running=9.0, requests_waiting=3.0, requests_deferred=2.0)
    assert for_decode(d, 8192, 20.0, RATE).bound == FLOOR_TOKENS



def test_with_no_handle_to_read_only_d_s_queue_bounds_it():
    """D's cache holds the history and no handle does: the P path would recompute the whole history, so neither
    streams nor local prefills in flight bound the suffix; a queue for room still does."""
    busy = dict(streams=12, waiting=0, in_flight=5000)
    assert local_bound(8192, 0.02, RATE, **busy).bound == FLOOR_TOKENS
    assert local_bound(8192, 0.02, RATE, **busy, else_whole_prefill=True).bound == 8192
    assert local_bound(8192, 0.02, RATE, streams=12, waiting=1, in_flight=0, else_whole_prefill=True).bound \
        == FLOOR_TOKENS


def test_this_gateway_s_own_local_prefills_waiting_on_d_are_no_queue_for_room():
    """D's step budget holds back a burst of local prefills: they wait in D's queue, but they are in flight already
    (`in_flight`), not a D short of room; one request more waiting than them is."""
    d = Engine("http://d", "decode", outstanding_requests=6, local_prefills=6, local_prefill_tokens=6000)
    d.data_plane = DataPlane(requests_running=2.0, requests_waiting=4.0)
    assert for_decode(d, 8192, 20.0, RATE).waiting == 0
    d.data_plane = DataPlane(requests_running=2.0, requests_waiting=7.0)
    assert for_decode(d, 8192, 20.0, RATE).bound == FLOOR_TOKENS
