"""State: the conversation through the store (claim, record, put back, find by prefix, pin budget); imports intake, reuse, legs, store, engines."""
