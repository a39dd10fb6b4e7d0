"""Intake: a validated client body made a TurnRequest (messages, chat template, prompt ids); imports store types only."""
