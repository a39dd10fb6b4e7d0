"""What every test conversation does with a turn's answer, whatever sends the turn (sims or real vLLM)."""

from __future__ import annotations

from typing import Any


class TurnTaking:
    """`say` and `send` for a test chat: subclasses hold `messages` and `turns` and define `ask(stream=...)`,
    which sends the current messages as one turn and returns it (with its answer in `.text`)."""

    messages: list[dict[str, Any]]
    turns: list[Any]

    def ask(self, *, stream: bool = False) -> Any:
        raise NotImplementedError

    def say(self, content: str, *, stream: bool = False) -> Any:
        self.messages.append({"role": "user", "content": content})
        return self.send(stream=stream)

    def send(self, *, stream: bool = False) -> Any:
        """Send the current messages as a turn; the answer joins the history."""
        turn = self.ask(stream=stream)
        self.messages.append({"role": "assistant", "content": turn.text})
        self.turns.append(turn)
        return turn
