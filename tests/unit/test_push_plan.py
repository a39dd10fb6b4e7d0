"""Push mode's pure parts (docs/protocol.md §8): the mode decision at start-up, P's identity from its handle, the
D leg's kv_transfer_params, the first plan and the local path without a handle, which leg of a pair may be
redone (`pairing`), and `replan` once a pair is given up. One table per decision."""

from __future__ import annotations

import pytest

from gateway.engines import kv
from gateway.engines.facts import KvTransfer
from gateway.engines.transfer import Seen, decide, mode_findings, mode_of
from gateway.turns.reuse.continuity import Fingerprint
from gateway.turns.reuse.pairing import PairStep, after_decode, after_prefill
from gateway.turns.reuse.plan import Claim, PlanKind, Reason, Setback, full
from gateway.turns.reuse.push_plans import adopt, first_plan as first_push_plan, pair, path as push_path, replan
from gateway.turns.run.push_leg import PushTransfer

BS = 4
HELD = list(range(50, 70))                  # D computed these last turn: R = 20


# -- the mode -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("kv_transfer", "mode"), [
    ({"connector": "NixlPushConnector"}, "push"),
    ({"connector": "NixlConnector"}, "pull"),
    ({"connector": "NixlPullConnector"}, "pull"),
    ({"connector": "MultiConnector", "connectors": ["NixlPushConnector", "LMCacheConnectorV1"]}, "push"),
    ({"connector": "MultiConnector", "connectors": ["NixlPushConnector", "NixlConnector"]}, None),
    ({"connector": "LMCacheConnectorV1"}, None),
    (None, None),                                    # no /server_info (vLLM without VLLM_SERVER_DEV_MODE=1)
])
def test_mode_of_server_info(kv_transfer, mode):
    assert mode_of(None if kv_transfer is None else KvTransfer(**kv_transfer)) == mode


P_PUSH, D_PUSH = Seen("prefill", "http://p", "push"), Seen("decode", "http://d", "push")
P_PULL, D_PULL = Seen("prefill", "http://p", "pull"), Seen("decode", "http://d", "pull")
P_NONE, D_NONE = Seen("prefill", "http://p", None), Seen("decode", "http://d", None)


@pytest.mark.parametrize(("setting", "engines", "mode", "refused", "unseen"), [
    ("auto", [P_PUSH, D_PUSH], "push", None, ()),
    ("auto", [P_PULL, D_PULL], "pull", None, ()),
    ("auto", [P_NONE, D_NONE], "pull", None, ()),               # nothing shown: today's pull
    ("auto", [P_PUSH, D_PULL], "pull", "mixed KV-transfer modes", ()),
    ("auto", [P_PUSH, D_NONE], "push", "show no mode", ()),     # a push leg to a pull D must not be risked
    ("push", [P_PUSH, D_NONE], "push", None, ("decode http://d",)),
    ("push", [P_PUSH, D_PULL], "push", "decode http://d runs pull mode", ()),
    ("pull", [P_PUSH, D_PULL], "pull", "prefill http://p runs push mode", ()),
    ("pull", [P_NONE, D_NONE], "pull", None, ()),
])
def test_mode_decision(setting, engines, mode, refused, unseen):
    verdict = decide(setting, engines)
    assert verdict.mode == mode and verdict.unseen == unseen
    assert verdict.basis.startswith("--kv-transfer-mode" if setting != "auto" else
                                    "no engine" if all(e.mode is None for e in engines) else "as ") or refused
    assert (verdict.refusal is None) if refused is None else (refused in verdict.refusal)
    levels = [level for level, _ in mode_findings(verdict, [])]
    assert levels == (["fail"] if refused else ["warn"] if unseen else [])


def p_handle(**changes) -> kv.Handle:
    """P's handle in push mode (nixl/push_scheduler.py:281-294)."""
    return kv.Handle({"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[3, 4]],
                      "remote_engine_id": "p0", "remote_request_id": "chatcmpl-r-1-abcd1234",
                      "remote_host": "10.0.0.5", "remote_port": 5600, "tp_size": 2, "dcp_size": 1, "pp_size": 1,
                      "remote_num_tokens": 7, "transfer_mode": "push", **changes})


@pytest.mark.parametrize(("handle", "target"), [
    (p_handle(), kv.PushTarget("p0", "10.0.0.5", 5600, 2, 1)),
    (p_handle(pp_size=2), kv.PushTarget("p0", "10.0.0.5", 5600, 2, 2)),
    (p_handle(transfer_mode="pull"), None),          # a pull P: no push leg may name it
    (kv.Handle({k: v for k, v in p_handle().wire.items() if k not in ("transfer_mode", "pp_size", "dcp_size")}),
     kv.PushTarget("p0", "10.0.0.5", 5600, 2, 1)),   # vLLM 0.25's push P says neither mode nor pp (H200, seen)
    (p_handle(remote_port=None), None),
    (p_handle(tp_size=True), None),
    (None, None),
])
def test_push_target_from_ps_handle(handle, target):
    assert kv.PushTarget.of(handle) == target


def test_push_decode_params_name_p_and_pin_the_ids():
    params = kv.push_decode_params(kv.PushTarget("p0", "h", 5600, 2, 1), b"[1,2,3]",
                                   kv.engine_base_id("/v1/chat/completions", "r-pair-1"))
    assert {k: v for k, v in params.items() if k != "prompt_token_ids"} == {
        "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "p0", "remote_host": "h",
        "remote_port": 5600, "tp_size": 2, "pp_size": 1,
        "remote_request_id": "chatcmpl-r-pair-1"}         # required by vLLM 0.32 (nixl/metadata.py:334)
    assert kv.engine_base_id("/v1/completions", "x") == "cmpl-x-0"
    assert bytes(params["prompt_token_ids"]) == b"[1,2,3]"
    # D alone (the local path in push mode): no flags, or a push engine would lease its blocks as a P's
    assert set(kv.push_decode_params(None, b"[1]")) == {"prompt_token_ids"}
    assert kv.push_decode_params(None) == {}


# -- the plan -------------------------------------------------------------------------------------------------
def claim(**changes) -> Claim:
    fields = dict(first_turn=False, handle=None, missing=Reason.PUSH_MODE, held=Fingerprint.of(HELD, 20, BS),
                  same_model=True, holder_usable=True)
    return Claim(**{**fields, **changes})


@pytest.mark.parametrize(("prompt", "changes", "reason", "verified"), [
    (HELD + [1, 2], {}, Reason.PUSH_MODE, 20),
    (HELD[:10] + [0] * 12, {}, Reason.PUSH_MODE, 8),                  # D computed the first 2 blocks of it
    ([0] * 22, {}, Reason.PREFIX_DIVERGED, 0),
    (HELD + [1], {"first_turn": True, "held": None}, Reason.FIRST_TURN, 0),
    (HELD + [1], {"missing": Reason.CONCURRENT_TURN}, Reason.CONCURRENT_TURN, 0),
    (HELD + [1], {"missing": Reason.PREVIOUS_TURN_FAILED}, Reason.PREVIOUS_TURN_FAILED, 0),
    (HELD + [1], {"holder_usable": False}, Reason.DECODE_UNAVAILABLE, 0),
    (HELD + [1], {"same_model": False}, Reason.MODEL_CHANGED, 0),
    (HELD + [1], {"held": None, "missing": None}, Reason.NO_HANDLE, 0),
])
def test_first_push_plan_is_a_full_pair_with_what_d_computed(prompt, changes, reason, verified):
    plan = first_push_plan(prompt, claim(**changes))
    assert (plan.kind, plan.reason, plan.verified_tokens, plan.reused_tokens) == (PlanKind.FULL, reason, verified, 0)
    assert pushed(plan) and PushTransfer.first_leg(plan) == "pair" and plan.handle is None and plan.release is None


def test_a_pull_era_handle_is_neither_read_nor_released_in_push_mode():
    stored = kv.Handle({"remote_num_tokens": 20, "remote_block_ids": [[1, 2, 3, 4, 5]]})
    plan = first_push_plan(HELD + [1], claim(handle=stored, missing=None))
    assert plan.handle is None and plan.release is None and plan.reason is Reason.PUSH_MODE


@pytest.mark.parametrize(("prompt_tokens", "on_holder", "bound", "kind", "hit"), [
    (23, True, 256, PlanKind.LOCAL, 20),     # 3 new tokens: D computes them from its cache's 20
    (22, True, 256, PlanKind.LOCAL, 20),
    (21, True, 256, PlanKind.LOCAL, 20),
    (20, True, 256, PlanKind.LOCAL, 16),     # D always computes the last token: the partial block too
    (23, False, 256, PlanKind.FULL, 0),      # another D: its cache holds nothing of it
    (300, True, 256, PlanKind.FULL, 0),      # too much for D alone
    (23, True, 0, PlanKind.FULL, 0),         # local off
])
def test_push_path_goes_local_on_the_holder_within_the_bound(prompt_tokens, on_holder, bound, kind, hit):
    plan = push_path(pair(Reason.PUSH_MODE, 20), prompt_tokens, BS, on_holder, bound)
    assert plan.kind is kind and pushed(plan) and plan.reused_tokens == hit
    assert PushTransfer.first_leg(plan) == ("decode" if kind is PlanKind.LOCAL else "pair")
    if kind is PlanKind.LOCAL:
        assert plan.reason is Reason.SHORT_SUFFIX and plan.handle is None


def test_plans_made_before_the_conversation_was_known_become_pairs():
    plan = adopt(full(Reason.STORE_UNAVAILABLE))
    assert pushed(plan) and PushTransfer.first_leg(plan) == "pair" and plan.reason is Reason.STORE_UNAVAILABLE


def pushed(plan) -> bool:
    """A push plan asks D to hold nothing, and its next turn finds `push_mode` (D never returns a handle)."""
    return not plan.hold and plan.unheld is Reason.PUSH_MODE and plan.handle is None


PAIR = pair(Reason.FIRST_TURN)
LOCAL = push_path(pair(Reason.PUSH_MODE, 20), 23, BS, True, 256)


@pytest.mark.parametrize(("plan", "leg", "setback", "reason", "blame"), [
    (PAIR, "prefill", Setback.FAILED, Reason.FIRST_TURN, True),        # the pair again, on another P
    (PAIR, "prefill", Setback.REFUSED, Reason.FIRST_TURN, True),
    (PAIR, "prefill", Setback.STALE, Reason.FIRST_TURN, False),        # P restarted: same engines, a new id
    (PAIR, "decode", Setback.FAILED, Reason.DECODE_FAILED, True),
    (PAIR, "decode", Setback.TIMEOUT, Reason.DECODE_FAILED, True),     # P never wrote, or D never registered
    (PAIR, "decode", Setback.REFUSED, Reason.FIRST_TURN, True),        # P's lease ran out before D was redone
    (LOCAL, "decode", Setback.FAILED, Reason.DECODE_FAILED, True),     # D alone failed: a pair on another D
    (LOCAL, "decode", Setback.REFUSED, Reason.DECODE_FAILED, True),
])
def test_replan_a_pair_given_up(plan, leg, setback, reason, blame):
    step = replan(plan, leg, setback)
    assert (step.next_leg, step.plan.reason, step.plan.kind, step.blame) == ("pair", reason, PlanKind.FULL, blame)
    assert pushed(step.plan) and step.costs_retry


# -- which leg of a pair is redone (pairing.py) ---------------------------------------------------------------
@pytest.mark.parametrize(("setback", "redone", "waiting", "step"), [
    (Setback.FAILED, 0, True, PairStep.REDO_P),        # same id, same P: it holds D's registration
    (Setback.TIMEOUT, 0, True, PairStep.REDO_P),
    (Setback.FAILED, 1, True, PairStep.REDO_PAIR),     # once in place; then another P, a new id
    (Setback.FAILED, 0, False, PairStep.REDO_PAIR),    # no D waits for it any more
    (Setback.REFUSED, 0, True, PairStep.WAIT_D),       # D cannot reach P either: its own failure will come
])
def test_after_prefill(setback, redone, waiting, step):
    assert after_prefill(setback, redone, waiting) is step


@pytest.mark.parametrize(("setback", "before", "running", "ok", "changed", "lease", "step"), [
    (Setback.REFUSED, True, True, False, False, True, PairStep.REDO_D),     # never registered: P's blocks wait
    (Setback.REFUSED, False, False, True, False, True, PairStep.REDO_D),
    (Setback.REFUSED, False, False, True, False, False, PairStep.REDO_PAIR),  # P's lease is over
    (Setback.REFUSED, False, False, False, False, True, PairStep.REDO_PAIR),  # P failed: nothing staged
    (Setback.FAILED, True, True, False, False, True, PairStep.WAIT_P),       # P's answer decides
    (Setback.FAILED, True, False, True, False, True, PairStep.REDO_D),       # ... P answered, same identity
    (Setback.FAILED, True, False, True, True, True, PairStep.REDO_PAIR),     # ... P restarted meanwhile
    (Setback.FAILED, True, False, False, False, True, PairStep.REDO_PAIR),   # ... P failed too
    (Setback.FAILED, False, False, True, False, True, PairStep.REDO_PAIR),   # after P answered: P may have written
    (Setback.TIMEOUT, False, False, True, False, True, PairStep.REDO_PAIR),  # aborted while it may be registered
    (Setback.TIMEOUT, True, True, False, False, True, PairStep.REDO_PAIR),
])
def test_after_decode(setback, before, running, ok, changed, lease, step):
    assert after_decode(setback, before_p_answered=before, p_running=running, p_ok=ok, identity_changed=changed,
                        within_lease=lease) is step


# -- P's identity (engines/transfer.py PushIdentities) ---------------------------------------------------------
class IdentityClient:
    """P answers the one-token leg with a handle in `mode`; D answers its leg; both recorded."""

    def __init__(self, mode: str = "push") -> None:
        self.mode, self.calls = mode, []

    async def post_json(self, url: str, path: str, body: dict, *, timeout_s: float, headers: dict) -> dict:
        self.calls.append((url, path, body, headers["X-Request-Id"]))
        if "://p" in url:
            return {"choices": [{"text": "x"}], "kv_transfer_params": p_handle(transfer_mode=self.mode).wire}
        return {"choices": [{"text": "y"}]}


async def learned(mode: str = "push", decode_healthy: bool = True):
    from gateway.engines.engine import Engine
    from gateway.engines.pool import EnginePool
    from gateway.engines.transfer import PushIdentities
    client, decode = IdentityClient(mode), EnginePool("decode", ["http://d0"])
    decode.engines["http://d0"].healthy = decode_healthy
    prefill = Engine("http://p0", "prefill")
    target = await PushIdentities(client, decode, "m", 16).learn(prefill)        # type: ignore[arg-type]
    return target, prefill.facts.push_target, client.calls


async def test_ps_identity_is_learned_from_one_pair_that_leaves_nothing_held():
    target, kept, calls = await learned()
    assert target == kept == kv.PushTarget("p0", "10.0.0.5", 5600, 2, 1)
    (p_url, p_path, p_body, p_rid), (d_url, d_path, d_body, d_rid) = calls
    assert (p_url, d_url) == ("http://p0", "http://d0") and p_path == d_path == "/v1/completions"
    assert p_rid == d_rid and p_body["prompt"] == d_body["prompt"] and len(p_body["prompt"]) == 18
    assert p_body["kv_transfer_params"]["do_remote_decode"] is True and p_body["max_tokens"] == 1
    params = d_body["kv_transfer_params"]     # D registers, P's WRITE frees P's blocks
    assert params["remote_engine_id"] == "p0" and params["remote_request_id"] == f"cmpl-{p_rid}-0"


async def test_a_p_answering_in_pull_mode_gets_no_identity():
    target, kept, calls = await learned("pull")
    assert target is None and kept is None and len(calls) == 1     # and no push leg is sent to D


async def test_without_a_healthy_d_the_identity_is_still_learned():
    target, _, calls = await learned(decode_healthy=False)
    assert target is not None and len(calls) == 1


async def test_a_p_coming_back_is_unknown_at_once_and_learned_again():
    import asyncio

    from gateway.engines.engine import Engine
    from gateway.engines.pool import EnginePool
    from gateway.engines.transfer import PushIdentities
    prefill = Engine("http://p0", "prefill")
    prefill.facts.push_target = kv.PushTarget("old", "h", 1)
    identities = PushIdentities(IdentityClient(), EnginePool("decode", ["http://d0"]), "m", 16)  # type: ignore[arg-type]
    identities.engine_back(prefill)
    assert prefill.facts.push_target is None            # a turn now sends P first and learns it itself
    await asyncio.gather(*identities._running)
    assert prefill.facts.push_target.engine_id == "p0"
