"""Push mode (vLLM's NixlPushConnector, docs/protocol.md §8): D registers the blocks it allocated with P, and P
writes its prefill's KV into them once both its finished blocks and the registration are there, in either order.

Two sim-to-sim calls stand in for NIXL, as `kv_reader.py`'s reads do in pull mode:
  POST /sim/kv/push-register  on P  `Registration`: D's request id and address, the block ids D allocated
  POST /sim/kv/push-write     on D  `Write`: D's request id and, per registered block, the slots P wrote
vLLM sends the first as a NIXL notification and the second as a WRITE with a completion notification: nobody
answers either, so neither engine learns of the other's failure (§8.4). The sims answer only what a handshake
would refuse (wrong engine id, block size or transfer mode), and otherwise drop silently what vLLM drops.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec
from litestar import MediaType, Request, Response, post
from litestar.handlers import HTTPRouteHandler

from gateway.sim.blocks import GARBAGE, BlockPool, Slot
from gateway.sim.failures import PushLegError
from gateway.sim.handles import HandleTable
from gateway.sim.reading import KVReader
from gateway.sim.engine_request import EngineRequest
from gateway.sim.settings import SimSettings
from gateway.sim.stats import SimStats
from gateway.sim.kv_reader import HolderAddress, KVClient, TransferError

# vLLM appends `-<8 hex>` to each engine's request id (v1/engine/input_processor.py:371); P pairs a registration
# with its finished blocks by the ids without it (nixl/utils.py:60-67, nixl/push_worker.py:398-428).
_RANDOM_SUFFIX = re.compile(r"-[0-9a-f]{8}$", re.IGNORECASE)
MAX_PENDING = 10_000  # unmatched registrations P keeps (vLLM keeps them without bound: nothing evicts them)


def base_id(request_id: str) -> str:
    return _RANDOM_SUFFIX.sub("", request_id)


class Registration(msgspec.Struct):
    request_id: str  # D's internal id
    engine_id: str  # P's engine id, as D's push leg names it (the handshake checks it)
    block_size: int
    decode_engine_id: str
    decode_host: str
    decode_port: int
    block_ids: list[int]  # D's blocks for the prompt, its prefix-cache hits left out (push_scheduler.py:171)


class Write(msgspec.Struct):
    request_id: str  # D's internal id, from the registration
    engine_id: str  # D's
    block_size: int
    blocks: list[list[tuple[int, int]]]  # per registered block, the slots written into it


_write_decoder = msgspec.json.Decoder(Write)


class FaultRequest(msgspec.Struct):
    push_fault: str
    times: int | None = None  # a test hook's count: the fault applies to this many P legs, then stops


class Pushes(Protocol):
    """What push mode uses of its engine (engine.py), read afresh on every call."""
    settings: SimSettings
    stats: SimStats
    pool: BlockPool
    handles: HandleTable
    kv: KVClient
    reader: KVReader            # its `failed` ends a load as the failure policy says
    push_sender: PushSender
    push_receiver: PushReceiver
    running: int
    waiting: int
    dead: str | None            # set when a push leg kills the engine core, as vLLM's KeyError does

    def spawn(self, coro: Any) -> None: ...


@dataclass(frozen=True)
class PushTarget:
    """P as a push-mode D leg names it: its identity, not its blocks (docs/protocol.md §8.2)."""

    host: str
    port: int
    engine_id: str
    request_id: str | None  # P's internal id: only a serial dispatcher knows it; it makes D heartbeat P

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> PushTarget:
        # vLLM 0.32 reads these with `params[...]`: the first four in nixl/push_scheduler.py:184-187, the request
        # id in nixl/metadata.py:334 once D schedules the request (seen: a KeyError there kills D's engine core)
        missing = [k for k in ("remote_engine_id", "remote_host", "remote_port", "tp_size", "remote_request_id")
                   if k not in params]
        if missing:
            raise PushLegError(f"push leg without {', '.join(missing)}")
        rid = params.get("remote_request_id")
        return cls(str(params["remote_host"]), int(params["remote_port"]), str(params["remote_engine_id"]),
                   str(rid) if rid else None)

    def url(self, path: str) -> str:
        return f"http://{self.host}:{self.port}{path}"

    @property
    def heartbeat(self) -> HolderAddress | None:
        # vLLM heartbeats P only with every remote field present, remote_request_id too (base_scheduler.py:207-238)
        return None if self.request_id is None else HolderAddress(self.host, self.port, self.engine_id,
                                                                  self.request_id)


class PushSender:
    """P's side: finished blocks staged for D's registration, registrations waiting for P's blocks, the WRITE."""

    def __init__(self, engine: Pushes) -> None:
        self.engine = engine  # read through it: /sim/reset and /sim/timing replace its pool, stats and settings
        self.staged: dict[str, list[int]] = {}  # P's request id -> its leased block ids, not yet matched
        self.pending: dict[str, Registration] = {}  # D's request id -> a registration P's blocks have not met
        self.fault_left: int | None = None  # POST /sim/push-fault's `times`: P legs the fault still applies to

    def fails(self, params: dict[str, Any] | None) -> bool:
        """--push-fault fail-prefill: this P leg ends abnormally, so P stages nothing (push_scheduler.py:252-258)."""
        s = self.engine.settings
        return (s.transfer_mode == "push" and s.role == "prefill" and s.push_fault == "fail-prefill"
                and bool(params) and bool(params.get("do_remote_decode")) and self._spend_fault())

    def _spend_fault(self) -> bool:
        """A counted fault (a transient one, for tests) applies to its P legs, then turns itself off."""
        if self.fault_left is not None:
            self.fault_left -= 1
            if self.fault_left <= 0:
                self.fault_left = None
                self.engine.settings = msgspec.structs.replace(self.engine.settings, push_fault="none")
        return True

    def finished(self, p_rid: str, block_ids: list[int]) -> None:
        """P's prefill finished normally and its blocks are leased: write now if D registered, else stage."""
        s = self.engine.settings
        if s.transfer_mode != "push":
            return
        if s.push_fault == "never-write" and self._spend_fault():  # vLLM logs a failed handshake or WRITE
            self.engine.stats.push_writes_withheld += 1               # submission, and tells D nothing
            return
        reg = _pop_match(self.pending, p_rid)
        if reg is None:
            self.staged[p_rid] = list(block_ids)
        else:
            self.engine.spawn(self._write(p_rid, block_ids, reg))

    def register(self, reg: Registration) -> tuple[int, str | None]:
        """A registration from D: (HTTP status, refusal). Matched with staged blocks, else kept pending."""
        s = self.engine.settings
        if s.transfer_mode != "push" or reg.engine_id != s.engine_id or reg.block_size != s.block_size:
            # the transfer mode is in NIXL's compatibility hash (nixl/base_worker.py:1391-1395)
            return 409, "handshake refused: engine id, block size or transfer mode mismatch"
        self.engine.stats.push_registrations_received += 1
        self._drop_expired()
        match = _pop_match(self.staged, reg.request_id, with_key=True)
        if match is None:
            if len(self.pending) >= MAX_PENDING:
                self.pending.pop(next(iter(self.pending)))
            self.pending[reg.request_id] = reg
        else:
            p_rid, block_ids = match
            self.engine.spawn(self._write(p_rid, block_ids, reg))
        return 200, None

    def _drop_expired(self) -> None:
        """Blocks whose lease ran out are no longer offered (the writer's eviction, push_worker.py:266-276)."""
        self.engine.handles.expire()
        for p_rid in [r for r in self.staged if r not in self.engine.handles.held]:
            del self.staged[p_rid]

    async def _write(self, p_rid: str, block_ids: list[int], reg: Registration) -> None:
        engine, n = self.engine, len(reg.block_ids)
        if n > len(block_ids):  # vLLM: the writer's block-count assertion fails; no WRITE (push_worker.py:683)
            engine.stats.push_writes_failed += 1
            return
        # D registered only what its prefix cache lacks: P writes its LAST n blocks (base_worker.py:3446-3455).
        slots = [list(engine.pool.blocks[i].slots) for i in block_ids[-n:]]
        # The WRITE on the wire, driven by P, with a pull read's fixed part: on the H200 push saved only 6-15 ms
        # over pull at 1.3k-4.3k tokens, of D's 60-ms hand-over (bench/GPU-RESULTS.md, "Push vs pull").
        if wire_ms := engine.settings.transfer_ms_per_read + n * engine.settings.transfer_ms_per_block:
            await asyncio.sleep(wire_ms / 1000)
        body = Write(reg.request_id, reg.decode_engine_id, engine.settings.block_size, slots)
        try:
            await engine.kv.post(f"http://{reg.decode_host}:{reg.decode_port}/sim/kv/push-write", body)
        except TransferError:  # logged and dropped by vLLM; P's lease frees its blocks (push_worker.py:726-743)
            engine.stats.push_writes_failed += 1
            return
        engine.stats.push_writes_sent += 1
        engine.stats.push_blocks_written += n
        engine.handles.claim(p_rid, "read")  # the WRITE completed: P frees its blocks (finished_sending)

    def clear(self) -> None:
        self.staged.clear()
        self.pending.clear()
        self.fault_left = None


@dataclass
class Waiter:
    """A D request registered with P, waiting for P's write."""

    table: list[int]
    future: asyncio.Future[list[list[Slot]]]
    orphaned: bool = False  # the request was aborted before the write: its blocks stay held until it comes


class PushReceiver:
    """D's side: register the blocks the prompt lacks with P, wait for P's write, take what it wrote."""

    def __init__(self, engine: Pushes) -> None:
        self.engine = engine
        self.waiting: dict[str, Waiter] = {}  # D's request id -> its waiter

    def takes(self, params: dict[str, Any] | None) -> bool:
        s = self.engine.settings
        return (s.transfer_mode == "push" and s.role == "decode" and bool(params)
                and bool(params.get("do_remote_prefill")))  # type: ignore[union-attr]

    def heartbeat_target(self, params: dict[str, Any] | None) -> HolderAddress | None:
        if not self.takes(params):
            return None
        try:
            return PushTarget.from_params(params).heartbeat  # type: ignore[arg-type]
        except PushLegError:
            return None

    async def receive(self, req: EngineRequest, table: list[int], num_hits: int) -> dict[int, Slot]:
        """The prompt positions P wrote, by position. Counted as waiting meanwhile (vLLM's
        WAITING_FOR_REMOTE_KVS). P unreachable or refusing the handshake is a failed load, under
        kv_load_failure_policy (nixl/push_worker.py:343-362)."""
        engine = self.engine
        with engine.waiting_meanwhile(deferred=True):
            try:
                return await self._receive(req, table, num_hits)
            except TransferError as exc:
                engine.stats.kv_load_failures += 1
                return engine.reader.failed(str(exc))

    async def _receive(self, req: EngineRequest, table: list[int], num_hits: int) -> dict[int, Slot]:
        try:
            target = PushTarget.from_params(req.kv_params)  # type: ignore[arg-type]
        except PushLegError as exc:  # a KeyError in vLLM's scheduler is fatal to its engine core (seen)
            self.engine.dead = f"EngineCore encountered a fatal error: {exc}"
            raise
        engine, s = self.engine, self.engine.settings
        waiter = Waiter(table, asyncio.get_running_loop().create_future())
        self.waiting[req.request_id] = waiter
        reg = Registration(req.request_id, target.engine_id, s.block_size, s.engine_id, s.host, s.port,
                           table[num_hits:])
        try:
            await engine.kv.post(target.url("/sim/kv/push-register"), reg)
            engine.stats.push_registrations_sent += 1
            blocks = await self._wait(waiter, s.registration_timeout)
        except TransferError:
            del self.waiting[req.request_id]
            raise
        except asyncio.CancelledError:
            # Aborted while waiting: vLLM frees the blocks only when the WRITE completes (scheduler.py:2700-2707),
            # so a late write cannot land in reused memory; if P never writes they stay held (vLLM #46283).
            if not waiter.future.done():
                waiter.orphaned = True
                engine.pool.touch(table)
            else:
                del self.waiting[req.request_id]
            raise
        del self.waiting[req.request_id]
        engine.stats.push_writes_received += 1
        engine.stats.push_blocks_received += len(blocks)
        return _positions(blocks, num_hits, len(req.prompt), s.block_size)

    async def _wait(self, waiter: Waiter, timeout_s: float) -> list[list[Slot]]:
        # shield: cancelling this request must not cancel the future a late write still resolves
        try:
            return await asyncio.wait_for(asyncio.shield(waiter.future), timeout_s)
        except TimeoutError:
            # vLLM's watchdog only drops the registration and logs (nixl/push_scheduler.py:303-327): the request
            # stays waiting, until the client goes away or a late write completes it.
            self.engine.stats.push_registrations_timed_out += 1
            return await asyncio.shield(waiter.future)

    def write(self, body: Write) -> tuple[int, str | None]:
        """P's write for one of D's requests: (HTTP status, refusal)."""
        s = self.engine.settings
        if body.engine_id != s.engine_id or body.block_size != s.block_size:
            return 409, "handshake refused: engine id or block size mismatch"
        waiter = self.waiting.get(body.request_id)
        if waiter is None or waiter.future.done():  # vLLM: "Unrecognized request ... notif (may have expired)"
            self.engine.stats.push_writes_unmatched += 1
            return 404, "no request waits for this write"
        if waiter.orphaned:  # the held blocks of an aborted request are freed now
            del self.waiting[body.request_id]
            self.engine.pool.release(waiter.table)
            self.engine.stats.push_writes_after_abort += 1
        else:
            waiter.future.set_result(body.blocks)      # msgspec made them (int, int) slots already
        return 200, None

    @property
    def orphans(self) -> int:
        return sum(1 for w in self.waiting.values() if w.orphaned)

    def clear(self) -> None:
        self.waiting.clear()


def _positions(blocks: list[list[Slot]], first_block: int, prompt_len: int, bs: int) -> dict[int, Slot]:
    """What D now holds for positions [first_block * bs, prompt_len - 1): the last prompt token is recomputed on
    D, as in pull mode. A slot P did not fill is uninitialised memory."""
    out = {}
    for p in range(first_block * bs, prompt_len - 1):
        block, j = blocks[p // bs - first_block], p % bs
        out[p] = block[j] if j < len(block) else GARBAGE
    return out


def _pop_match(table: dict[str, Any], request_id: str, *, with_key: bool = False) -> Any:
    """vLLM's lookup: the exact id first, then the first entry with the same base id (push_worker.py:398-428)."""
    key = request_id if request_id in table else next(
        (k for k in table if base_id(k) == base_id(request_id)), None)
    if key is None:
        return None
    value = table.pop(key)
    return (key, value) if with_key else value


def _json(payload: Any, status: int = 200) -> Response:
    return Response(content=msgspec.json.encode(payload), status_code=status, media_type=MediaType.JSON)


def _answer(status: int, refusal: str | None) -> Response:
    if refusal is None:
        return _json({"ok": True})
    return _json({"error": {"message": refusal, "type": "BadRequestError", "param": None, "code": status}}, status)


def push_routes(engine: Pushes) -> list[HTTPRouteHandler]:
    @post("/sim/kv/push-register", status_code=200)
    async def push_register(data: Registration) -> Response:
        return _answer(*engine.push_sender.register(data))

    @post("/sim/kv/push-write", status_code=200)
    async def push_write(request: Request) -> Response:
        # decoded here, as pull's /sim/kv/read is: through Litestar's `data: Write` a 32k-token write took 20-100
        # ms more (measured), a cost of the simulator's that pull mode did not pay (bench/push.py)
        try:
            body = _write_decoder.decode(await request.body())
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return _answer(400, f"bad write: {exc}")
        return _answer(*engine.push_receiver.write(body))

    @post("/sim/push-fault", status_code=200)
    async def push_fault(data: FaultRequest) -> Response:
        """Test hook: change this engine's --push-fault while it runs."""
        if data.push_fault not in ("none", "fail-prefill", "never-write"):
            return _answer(400, f"unknown push fault {data.push_fault!r}")
        engine.settings = msgspec.structs.replace(engine.settings, push_fault=data.push_fault)
        engine.push_sender.fault_left = data.times if data.push_fault != "none" else None
        return _json({"push_fault": data.push_fault, "times": engine.push_sender.fault_left})

    return [push_register, push_write, push_fault]
