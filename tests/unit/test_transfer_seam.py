"""The KV-transfer protocol is one object the runner asks (turns/run/transfer_protocol.py): a third protocol, here
one whose legs share a room id as some other connectors' do, plugs in with no change to the runner, the plans or
the legs, and this file is all it touches. Not shipped: it shows the seam, and fails where the runner plans, builds
D's body or replans a setback without asking the protocol."""

from __future__ import annotations

from typing import Any

from gateway.engines.engine import Engine
from gateway.errors import EngineFailedError
from gateway.turns.legs.bodies import decode_body
from gateway.turns.reuse.plan import Claim, Leg, Plan, PlanKind, Reason, Replan, Setback
from gateway.turns.run.path_choice import PathChoice
from gateway.turns.run.prefill_leg import PrefillLeg
from gateway.turns.run.turn import Turn, TurnReply
from tests.unit.test_turn_runner import KEY, built, by_leg, decode_answer, failing_first, prefill_answer, reads_d


class RoomTransfer:
    """Every turn P then D, the two legs naming one room; nothing of D's KV is read or held across turns."""

    mode = "room"
    reads_d_kv = False

    def __init__(self, prefill_leg: PrefillLeg) -> None:
        self.prefill_leg, self.rooms = prefill_leg, []

    @staticmethod
    def first_plan(prompt: list[int], claim: Claim) -> Plan:
        return Plan(PlanKind.FULL, Reason.FIRST_TURN if claim.first_turn else Reason.NO_HANDLE, hold=False)

    @staticmethod
    def adopt(plan: Plan) -> Plan:
        return Plan(plan.kind, plan.reason, hold=False) if plan.handle or plan.release else plan

    @staticmethod
    def choose_path(turn: Turn, paths: PathChoice) -> Engine | None:
        return None

    @staticmethod
    def first_leg(plan: Plan) -> Leg:
        return "prefill"

    async def from_prefill(self, turn: Turn, prefill: Engine) -> TurnReply | None:
        await self.prefill_leg.run(turn, prefill)
        return None

    def decode_body(self, turn: Turn) -> dict[str, Any]:
        body = decode_body(turn.req, None)
        body["kv_transfer_params"] = {"room": f"{turn.req.request_id}-{len(self.rooms)}"}
        self.rooms.append(body["kv_transfer_params"]["room"])
        return body

    @staticmethod
    def replan(plan: Plan, leg: Leg, setback: Setback) -> Replan:
        return Replan(Plan(PlanKind.FULL, Reason.DECODE_FAILED, hold=False), "prefill", blame=True, costs_retry=True)

    async def drain(self) -> None:
        return None


async def run_with_rooms(script) -> tuple[Any, RoomTransfer, TurnReply]:
    client, runner, req = await built(script)
    runner.transfer = protocol = RoomTransfer(runner.prefill_leg)
    reply = await runner.run(req, KEY)
    await runner.drain()
    return client, protocol, reply


def d_bodies(client) -> list[dict[str, Any]]:
    return [body for url, body in client.calls if "://d" in url]


async def test_a_third_protocol_runs_its_legs_with_its_own_bodies():
    client, protocol, reply = await run_with_rooms(by_leg(prefill_answer))
    assert [body["kv_transfer_params"] for body in d_bodies(client)] == [{"room": "r-0"}]
    assert (reply.headers["X-PD-Plan"], reply.headers["X-PD-Reason"]) == ("full", "no_handle")
    assert protocol.rooms == ["r-0"]
    # no leg of the turn reads the conversation's stored handle (its release, a zero-token read, is the state's)
    assert not any(reads_d(body) for _, body in client.calls if "messages" in body)


async def test_its_replan_decides_what_follows_a_failed_leg():
    client, protocol, reply = await run_with_rooms(
        by_leg(prefill_answer, failing_first(EngineFailedError("500"), decode_answer)))
    assert protocol.rooms == ["r-0", "r-1"]                   # both legs again, in a new room
    legs = [url[7:9] for url, body in client.calls if "messages" in body]
    assert [leg[0] for leg in legs] == ["p", "d", "p", "d"] and legs[1] != legs[3]   # D blamed: another D
    assert (reply.headers["X-PD-Plan"], reply.headers["X-PD-Reason"]) == ("full", "decode_failed")
