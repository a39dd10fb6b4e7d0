"""The KV-transfer protocol as one object (issue 39): how a turn is planned, which path it takes, how its legs run
and are redone, and what D's leg is sent, for one way of moving KV from P to D. Chosen at assembly
(`protocol_for`): pull (NixlConnector: D reads P's KV, P may read D's; `PullTransfer` here) or push
(NixlPushConnector: P writes into D's blocks; `push_leg.PushTransfer`). The runner asks it and branches on no mode;
a third protocol is one more class with these methods (tests/unit/test_transfer_seam.py plugs one in)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from gateway.config import Settings
from gateway.engines.engine import Engine
from gateway.engines.probe import pinned_ids_proven
from gateway.engines.transfer import Mode
from gateway.telemetry import Metrics
from gateway.turns.legs.bodies import decode_body
from gateway.turns.legs.calls import EngineCalls
from gateway.turns.reuse import plan as plans
from gateway.turns.reuse.plan import Claim, Leg, Plan, Replan, Setback
from gateway.turns.run.decode_leg import DecodeLeg
from gateway.turns.run.path_choice import PathChoice
from gateway.turns.run.prefill_leg import PrefillLeg
from gateway.turns.run.push_leg import PushLeg, PushTransfer
from gateway.turns.run.turn import Turn, TurnReply


class TransferProtocol(Protocol):
    mode: str
    reads_d_kv: bool       # P may read D's KV: the calibration read and the cost plan's rates apply

    def first_plan(self, prompt: list[int], claim: Claim) -> Plan:
        """The plan from what the store returned and what the prompt rendered to."""

    def adopt(self, plan: Plan) -> Plan:
        """A plan made before anything was known of the conversation (no session, store down), in its terms."""

    def choose_path(self, turn: Turn, paths: PathChoice) -> Engine | None:
        """Once D is picked: the plan's path (D alone or through P); a P picked now, for the first P leg."""

    def first_leg(self, plan: Plan) -> Leg:
        """The leg the runner starts with ("decode": D alone)."""

    async def from_prefill(self, turn: Turn, prefill: Engine) -> TurnReply | None:
        """The legs from P's on: None when D's leg follows (the runner sends it), else the turn's reply."""

    def decode_body(self, turn: Turn) -> dict[str, Any]:
        """What D's leg is sent."""

    def replan(self, plan: Plan, leg: Leg, setback: Setback) -> Replan:
        """After a leg's setback (a `LegSetback` the legs raised): the next plan and leg."""

    async def drain(self) -> None:
        """Work the protocol left running after its turns (on shutdown)."""


class PullTransfer:
    """Pull mode: P prefills (reading D's KV where the plan holds a handle), then D reads P's KV; or D alone on the
    local path."""

    mode = "pull"
    reads_d_kv = True
    first_plan = staticmethod(plans.first_plan)
    replan = staticmethod(plans.replan)

    def __init__(self, prefill_leg: PrefillLeg) -> None:
        self.prefill_leg = prefill_leg

    @staticmethod
    def adopt(plan: Plan) -> Plan:
        return plan

    @staticmethod
    def choose_path(turn: Turn, paths: PathChoice) -> Engine | None:
        return paths.choose(turn)

    @staticmethod
    def first_leg(plan: Plan) -> Leg:
        return "decode" if plan.local else "prefill"

    async def from_prefill(self, turn: Turn, prefill: Engine) -> TurnReply | None:
        await self.prefill_leg.run(turn, prefill)
        return None

    @staticmethod
    def decode_body(turn: Turn) -> dict[str, Any]:
        return decode_body(turn.req, turn.prefill_handle, local=turn.plan.local, hold=turn.plan.hold,
                           stub=pinned_ids_proven(turn.decode))      # D uses the ids it is sent: no history text

    async def drain(self) -> None:
        return None


def protocol_for(mode: Mode, prefill_leg: PrefillLeg, decode_leg: DecodeLeg, calls: EngineCalls, metrics: Metrics,
                 settings: Settings, pick: Callable[[Turn, Leg], Engine]) -> TransferProtocol:
    """The engines' mode (engines/transfer.py decides it at start-up) as the protocol object turns run with."""
    if mode == "push":
        return PushTransfer(PushLeg(prefill_leg, decode_leg, calls, metrics, settings, pick))
    return PullTransfer(prefill_leg)
