"""Stop strings in a growing generation, found by decoding only its tail.

``generate_until`` stops a request once its text holds one of the task's ``until`` strings.
Decoding the whole output after every step to look for them is O(n^2) in the output length;
a stop string that appears with this step's tokens ends in their text, so it lies inside
the new tokens plus enough earlier ones to hold the longest stop string::

    tokens   t0 t1 ... t(i-1) | t(i) ... t(checked-1) | t(checked) ... t(n-1)
             scanned before     lookback: >= `need`     new this step
                                characters of text

The final text is still cut from one decode of every token (the ``hf`` backend's
``postprocess_generated_text``), so the scan decides only *when* to stop, never the output.
"""

from __future__ import annotations

from typing import Callable, Sequence

# Characters of slack past the longest stop string: a UTF-8 character split between the
# lookback and the new tokens decodes as up to 3 replacement characters on its own.
SPLIT_CHAR_SLACK = 4


class StopScan:
    """Whether one request's text holds a stop string yet, checked step by step.

    Args:
      decode: token ids -> text (the backend's ``tok_decode``; special tokens may decode to
        nothing: the lookback then grows until it holds enough text).
      stops: the stop strings (empty ones are ignored).
    """

    def __init__(self, decode: Callable[[list[int]], str], stops: Sequence[str]):
        self.decode = decode
        self.stops = [s for s in stops if s]
        self.need = max(map(len, self.stops), default=0) + SPLIT_CHAR_SLACK
        self.checked = 0  # tokens whose text has been scanned

    def found(self, tokens: Sequence[int]) -> bool:
        """Whether ``tokens`` (the whole output so far; it only grows between calls) holds a
        stop string in its text. Decodes O(new tokens + longest stop) tokens a call."""
        if not self.stops or len(tokens) <= self.checked:
            return False
        start = self._lookback_start(tokens)
        text = self.decode(list(tokens[start:]))
        self.checked = len(tokens)
        return any(s in text for s in self.stops)

    def _lookback_start(self, tokens: Sequence[int]) -> int:
        """The first token of a lookback before the new tokens whose text has at least
        ``need`` characters (or the output's start): ``need`` tokens, doubled while short."""
        back = self.need
        while True:
            start = max(0, self.checked - back)
            if start == 0 or len(self.decode(list(tokens[start:self.checked]))) >= self.need:
                return start
            back *= 2
