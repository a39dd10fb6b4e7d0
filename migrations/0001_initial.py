"""Layout v1: one hash per conversation at `pdgw:v1:conv:{tenant}:{blake2b-128(session) hex}` with fields
record, handle, handle_expires_at, started, finished, started_at (see gateway/store/scripts.py).

Nothing came before v1, so there is nothing to convert: applying this only records the version.
"""

VERSION = 1
DESCRIPTION = "conversation layout v1: pdgw:v1:conv:{tenant}:{session digest} hashes"


async def up(redis) -> None:
    return None
