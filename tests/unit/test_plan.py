from gateway.turns.continuity import Fingerprint
from gateway.turns.plan import FRESH_PREFILL_PARAMS, PlanKind, Reason, plan_with_handle, release_params, truncate

BS = 4
S = list(range(50, 70))


def handle(r: int, groups: int = 1) -> dict:
    blocks = -(-r // BS)
    return {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": "d0",
            "remote_block_ids": [list(range(10, 10 + blocks)) for _ in range(groups)],
            "remote_request_id": "chatcmpl-x-abcd1234", "remote_host": "127.0.0.1", "remote_port": 9,
            "remote_num_tokens": r, "remote_blocks_expiry_time": 123.0, "tp_size": 1}


def test_reuse_passes_the_handle_verbatim():
    h = handle(19)
    plan = plan_with_handle(S + [1], Fingerprint.of(S, 19, BS), h)
    assert (plan.kind, plan.reason, plan.reused_tokens) == (PlanKind.REUSE, Reason.CONTINUOUS, 19)
    assert plan.prefill_params == h and plan.release is None


def test_partial_cuts_blocks_and_count():
    plan = plan_with_handle(S[:10] + [0] * 10, Fingerprint.of(S, 19, BS), handle(19))
    assert plan.kind == PlanKind.PARTIAL and plan.reason == Reason.PREFIX_DIVERGED
    assert plan.handle["remote_num_tokens"] == 8 and plan.handle["remote_block_ids"] == [[10, 11]]
    assert plan.release is None           # P's read notifies D, which frees the whole request


def test_multi_group_handles_are_never_cut():
    plan = plan_with_handle(S[:10] + [0] * 10, Fingerprint.of(S, 19, BS), handle(19, groups=2))
    assert plan.kind == PlanKind.FULL and plan.release is not None


def test_full_releases_the_claimed_handle():
    h = handle(19)
    plan = plan_with_handle([0] * 30, Fingerprint.of(S, 19, BS), h)
    assert plan.kind == PlanKind.FULL and plan.release is h
    assert plan.prefill_params == FRESH_PREFILL_PARAMS


def test_handle_disagreeing_with_fingerprint_is_not_used():
    plan = plan_with_handle(S + [1], Fingerprint.of(S, 19, BS), handle(18))
    assert plan.kind == PlanKind.FULL and plan.reason == Reason.HANDLE_SHAPE


def test_truncate_and_release_leave_the_original_alone():
    h = handle(19)
    cut = truncate(h, 8, BS)
    assert h["remote_num_tokens"] == 19 and cut["remote_block_ids"] == [[10, 11]]
    assert release_params(h)["remote_num_tokens"] == 0 and h["remote_num_tokens"] == 19
