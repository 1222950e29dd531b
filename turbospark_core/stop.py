"""Stop strings over streamed text: hold back what could still become a stop."""

from __future__ import annotations

from turbospark_core.errors import OptionError


class StopMatcher:
    """Feed text pieces; emits what is safe and says when a stop string appeared."""

    def __init__(self, stop: str | list[str] | None) -> None:
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if any(not isinstance(s, str) or not s for s in stops):
            msg = f"stop={stop!r} must be a non-empty string or a list of non-empty strings"
            raise OptionError(msg)
        self.stops = stops
        self._held = ""

    def feed(self, piece: str, *, final: bool = False) -> tuple[str, bool]:
        """Returns ``(text to emit, stopped)``."""
        text = self._held + piece
        if not self.stops:
            return text, False
        hits = [(text.find(s), s) for s in self.stops if s in text]
        if hits:
            self._held = ""
            return text[: min(hits)[0]], True
        keep = 0 if final else self._longest_partial(text)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], False

    def _longest_partial(self, text: str) -> int:
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:n]):
                    best = max(best, n)
                    break
        return best
