"""Reuse: pure decisions on what a turn reuses (continuity, plan, cost, rates, prefix lookup keys); imports intake, engines.kv."""
