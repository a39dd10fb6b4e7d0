"""Run: one turn as it runs (`Turn`, its admission), its legs as sent (P, D, a push pair), the KV-transfer
protocols that plan and run them, and its ending (outcome); imports intake, reuse, legs, state, engines, store."""
