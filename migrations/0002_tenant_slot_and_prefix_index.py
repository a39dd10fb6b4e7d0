"""Layout v2: every key of a tenant starts `pdgw:v2:{tenant}:` (one Redis Cluster slot per tenant, so one script
can update a conversation and the tenant's prefix index together):

    pdgw:v2:{tenant}:conv:<blake2b-128(session) hex>   the conversation hash: v1's fields plus session, held,
                                                       indexed (see gateway/store/scripts.py)
    pdgw:v2:{tenant}:pfx:<16-byte index hash>          sorted set: session digests by handle expiry

This moves each v1 hash `pdgw:v1:conv:<tenant>:<digest>` to its v2 name with its fields and remaining TTL.
v1 records never stored their session id, so a moved conversation is not in the prefix index until its next
turn (found by its session id as before) files it. Idempotent: a v2 key that already exists is kept (a turn
served by a v2 gateway wrote it) and the v1 key is dropped either way.
"""

VERSION = 2
DESCRIPTION = "layout v2: pdgw:v2:{tenant}:conv:<digest> hashes and pdgw:v2:{tenant}:pfx:<hash> prefix index"

V1_PATTERN = "pdgw:v1:conv:*"


async def up(redis) -> None:
    # Single-key commands only: the old and new names of one conversation lie in different Cluster slots.
    async for old in redis.scan_iter(match=V1_PATTERN, count=1000):
        name = old.decode() if isinstance(old, bytes) else old
        tenant, _, digest = name[len("pdgw:v1:conv:"):].rpartition(":")
        new = f"pdgw:v2:{{{tenant}}}:conv:{digest}"
        fields, ttl_ms = await redis.hgetall(old), await redis.pttl(old)
        if fields and ttl_ms != -2 and not await redis.exists(new):
            await redis.hset(new, mapping=fields)
            if ttl_ms > 0:
                await redis.pexpire(new, ttl_ms)
        await redis.delete(old)
