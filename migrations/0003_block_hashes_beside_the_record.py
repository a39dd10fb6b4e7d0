"""Layout v2, conversation hash fields `blocks` and `blocks_of` (see gateway/store/scripts.py): a record's block
hashes kept beside it, so a turn sends only its new blocks' hashes and a replica's next claim of a conversation
it wrote does not read them back.

Nothing to convert: a record written before (its hashes inside it, no valid `blocks_of`) is read with its own
hashes, and its next turn's finish writes them beside it. The same holds while replicas of both versions run:
a record an earlier replica writes leaves `blocks_of` naming an older turn, so it is read with its own hashes;
an earlier replica reading a record written beside its hashes sees none, and only loses partial reuse and the
prefix index entry of that conversation until a newer replica serves it. Applying this records the version.
"""

VERSION = 3
DESCRIPTION = "layout v2: a record's block hashes beside it (fields blocks, blocks_of)"


async def up(redis) -> None:
    return None
