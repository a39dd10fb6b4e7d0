"""The pin ledger and budget decisions as ConversationState carries them out, over the embedded store: idle
handles leave the store before D's blocks are freed, a claimed one is never taken, the next turn says evicted."""

from __future__ import annotations

from typing import Any

from gateway.config import Settings
from gateway.engines import kv
from gateway.engines.pool import EnginePool
from gateway.store import ConversationKey, MemoryConversationStore
from gateway.telemetry import Metrics
from gateway.turns.state.budget import PinBudget
from gateway.turns.legs.capture import DecodeCapture
from gateway.turns.state.earning import PinEarnings
from gateway.turns.state.pins import PinLedger
from gateway.engines.dataplane import DataPlane
from gateway.turns.reuse.plan import Plan, PlanKind, Reason
from gateway.turns.intake.request import TurnRequest
from gateway.turns.state.state import ConversationState, Served

BS = 4
D = "http://d0"
D_NAME = "decode-0"         # engines are labelled by name, never by URL


class Releaser:
    """Stands in for HandleReleaser: what was released and why (the zero-token read is release.py's)."""

    def __init__(self) -> None:
        self.released: list[tuple[int | None, str]] = []

    def release(self, handle: kv.Handle, why: str) -> None:
        self.released.append((handle.num_tokens, why))


def make_state(capacity: int | None, fraction: float = 0.5) -> tuple[ConversationState, Releaser, Metrics]:
    settings = Settings(prefill=["http://p0"], decode=[D])
    decode = EnginePool("decode", settings.decode)
    if capacity is not None:
        decode.get(D).facts.num_gpu_blocks = capacity
    releaser, metrics = Releaser(), Metrics()
    metrics.engine_names[D] = D_NAME
    state = ConversationState(store=MemoryConversationStore(), decode=decode, releaser=releaser,  # type: ignore[arg-type]
                              metrics=metrics, settings=settings, block_size=BS, renderer=None,
                              pins=PinLedger(PinBudget(fraction, BS)))
    return state, releaser, metrics


def request(prompt: int) -> TurnRequest:
    return TurnRequest(endpoint="/v1/completions", body={}, model="m", prompt_ids=list(range(prompt)),
                       stream=False, want_token_ids=False, include_usage=False, request_id="r")


def capture(prompt: int, output: int, handle_id: int) -> DecodeCapture:
    handle = kv.Handle({"do_remote_decode": True, "remote_engine_id": "d0", "remote_block_ids": [[handle_id]],
                        "remote_num_tokens": prompt + output - 1, "remote_host": "h", "remote_port": 1})
    return DecodeCapture(prompt_ids=list(range(prompt)), output_ids=[1] * output, handle=handle,
                         finish_reason="stop", output_ids_seen=True)


async def turn(state: ConversationState, session: str, prompt: int, output: int = 1, handle_id: int = 0) -> Any:
    """One whole turn that leaves a handle of prompt+output-1 tokens on D; returns its start and claim."""
    key = ConversationKey("t", session)
    req = request(prompt)
    found, claim = await state.begin(req, key)
    start = found.start
    await state.record(req, key, start, Plan(PlanKind.FULL, Reason.FIRST_TURN), Served("http://p0", D),
                       capture(prompt, output, handle_id))
    return start, claim


def value(metrics: Metrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


async def test_over_budget_the_least_recently_used_idle_handle_is_evicted_and_its_next_turn_says_so():
    state, releaser, metrics = make_state(capacity=20)          # budget: 10 blocks of 4 tokens
    await turn(state, "a", 16)                                  # 16 tokens: 4 blocks
    await turn(state, "b", 16)
    assert releaser.released == []
    await turn(state, "c", 16)                                  # 12 blocks > 10: a, the oldest, goes
    assert releaser.released == [(16, "evicted")]
    assert await state.store.get(ConversationKey("t", "a")) is not None
    assert (await state.store.get(ConversationKey("t", "a")))[1] is None      # out of the store first
    assert value(metrics, "pdgw_handles_evicted_total", engine=D_NAME) == 1
    assert value(metrics, "pdgw_pinned_tokens", engine=D_NAME) == 32
    _, claim = await turn(state, "a", 20)
    assert claim.handle is None and claim.missing == Reason.BUDGET_EVICTED


async def test_a_claimed_handle_is_never_evicted():
    state, releaser, _ = make_state(capacity=20)
    await turn(state, "a", 16)
    await turn(state, "b", 16)
    key_a = ConversationKey("t", "a")
    found, claim = await state.begin(request(20), key_a)        # a's turn is reading its handle
    start = found.start
    assert claim.handle is not None
    await turn(state, "c", 16)                                  # over: b goes, not the older but claimed a
    assert releaser.released == [(16, "evicted")]
    assert (await state.store.get(ConversationKey("t", "b")))[1] is None
    await state.record(request(20), key_a, start, Plan(PlanKind.REUSE, Reason.CONTINUOUS), Served("http://p0", D),
                       capture(20, 1, 9))
    assert (await state.store.get(key_a))[1] is not None        # a's new handle stored


async def test_a_handle_larger_than_the_budget_is_released_not_stored():
    state, releaser, _ = make_state(capacity=20)
    await turn(state, "a", 48)                                  # 12 blocks > 10
    assert releaser.released == [(48, "evicted")]
    record, handle, _ = await state.store.get(ConversationKey("t", "a"))
    assert not handle and record.handle_note == "never_kept"      # {}: nothing pinned, findable by its tokens
    _, claim = await turn(state, "a", 52)
    assert claim.missing == Reason.NEVER_KEPT


async def test_unknown_capacity_or_budget_off_evicts_nothing():
    for state, releaser, _ in (make_state(capacity=None), make_state(capacity=20, fraction=0.0)):
        for session in "abcd":
            await turn(state, session, 16)
        assert releaser.released == []


async def test_a_conversations_own_handle_is_replaced_not_evicted():
    state, releaser, metrics = make_state(capacity=20)
    for prompt in (16, 24, 32):                                 # one conversation growing: 4, 6, 8 blocks
        await turn(state, "a", prompt)
    assert releaser.released == []
    assert value(metrics, "pdgw_pinned_tokens", engine=D_NAME) == 32


async def test_deleting_a_conversation_takes_its_pin_out_of_d_s_budget():
    from gateway.turns.admin_actions import ConversationAdmin
    state, releaser, metrics = make_state(capacity=100)
    await turn(state, "a", 16)
    assert value(metrics, "pdgw_pinned_tokens", engine=D_NAME) == 16
    admin = ConversationAdmin(state.store, releaser, state.pins)   # type: ignore[arg-type]
    assert await admin.delete(ConversationKey("t", "a"))
    assert releaser.released[-1] == (16, "deleted")
    assert value(metrics, "pdgw_pinned_tokens", engine=D_NAME) == 0 and state.pins.pins.pinned_tokens(D) == 0


def make_adaptive(capacity: int) -> tuple[ConversationState, Releaser, Metrics]:
    state, releaser, metrics = make_state(capacity)
    earnings = PinEarnings(0.5, state.settings.handle_ttl_s)
    state.pins.pins = PinLedger(PinBudget(0.5, BS), earnings)
    return state, releaser, metrics


async def test_d_short_of_blocks_pins_nothing_and_its_next_turn_is_a_full_prefill_with_a_reason():
    """D's own readings (its /metrics, on the health loop) say it preempts: the pin budget falls to 0, the idle
    handle goes, the new one is released at once (stateless PD's behaviour), the next turn says evicted."""
    state, releaser, metrics = make_adaptive(capacity=100)
    await turn(state, "a", 16)
    assert releaser.released == []
    holder = state.decode_pool.get(D)
    for t, preemptions in enumerate((0, 1, 2, 3, 4, 5, 6)):
        holder.observe(DataPlane(kv_cache_usage=0.99, requests_waiting=3, preemptions=preemptions, scraped_at=t + 1))
        state.pins.pins.earnings.of(D).observe(holder.data_plane)
    await turn(state, "b", 16)
    assert sorted(releaser.released) == [(16, "evicted"), (16, "evicted")]
    assert value(metrics, "pdgw_pin_budget_blocks", engine=D_NAME) == 0
    assert value(metrics, "pdgw_pinned_tokens", engine=D_NAME) == 0
    pins = state.pins.summaries[D]
    assert pins["pressure_factor"] == 0.0 and pins["budget_blocks"] == 0 and pins["configured_budget_blocks"] == 50
    _, claim = await turn(state, "b", 20)
    assert claim.handle is None and claim.missing == Reason.NEVER_KEPT


async def test_a_used_handle_counts_its_saved_tokens():
    state, _, metrics = make_adaptive(capacity=100)
    await turn(state, "a", 16)
    key = ConversationKey("t", "a")
    found, claim = await state.begin(request(20), key)
    assert claim.handle is not None
    await state.record(request(20), key, found.start, Plan(PlanKind.REUSE, Reason.CONTINUOUS, 16),
                       Served("http://p0", D), capture(20, 1, 9))
    assert value(metrics, "pdgw_pin_saved_tokens_total", engine=D_NAME) == 16
    info = state.pins.summaries[D]
    assert info["used"] == 1 and info["saved_tokens"] == 16 and info["policy"] == "adaptive"


async def test_replicas_on_one_store_share_d_s_budget():
    """Two replicas beating on one store each pin half of D's budget; alone again, the whole of it."""
    from gateway.turns.state.replicas import ALIVE_BEATS, ReplicaShare
    store = MemoryConversationStore()
    one, two = PinBudget(0.5, BS), PinBudget(0.5, BS)
    a, b = ReplicaShare(store, one, 1.0, "a"), ReplicaShare(store, two, 1.0, "b")
    assert await a.beat(10.0) == 1 and one.budget_blocks(100) == 50
    assert await b.beat(10.5) == 2 and two.budget_blocks(100) == 25
    assert await a.beat(11.0) == 2 and one.budget_blocks(100) == 25
    assert await a.beat(11.0 + ALIVE_BEATS + 0.1) == 1 and one.budget_blocks(100) == 50   # b stopped beating


async def test_admin_engines_shows_each_d_s_pin_share_as_of_the_last_beat():
    """`/admin/engines`' `pin_share`: the replicas this one last counted and its share of D's budget, read now
    (before any handle is stored, and after the count changed with no turn since)."""
    from gateway.turns.admin_actions import EngineAdmin
    from gateway.turns.state.replicas import ReplicaShare
    state, _, _ = make_state(capacity=100)
    admin = EngineAdmin(EnginePool("prefill", ["http://p0"]), state.decode_pool, None, state.pins)  # type: ignore[arg-type]
    [d] = [e for e in admin.describe() if e["role"] == "decode"]
    assert d["pin_share"] == {"replicas": 1, "budget_blocks": 50}
    store = MemoryConversationStore()
    await ReplicaShare(store, PinBudget(0.5, BS), 1.0, "other").beat(10.0)
    await ReplicaShare(store, state.pins.pins.budget, 1.0, "this").beat(10.0)
    [d] = [e for e in admin.describe() if e["role"] == "decode"]
    assert d["pin_share"] == {"replicas": 2, "budget_blocks": 25}
