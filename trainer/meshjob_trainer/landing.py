"""How far a receive's bytes have landed, read from its own buffer: marker words written before it is posted.

gloo's TCP transport reads a message straight into the receive buffer, front to back, as its bytes arrive
(seen here: a 64 MiB irecv's buffer fills by the millisecond, not at its completion). So the receiver
can tell how much of a message is in without asking the sender: before posting the receive, write one
random 8-byte word (MARKER) at a few offsets; a word that no longer holds it has been overwritten by the
payload, and so has every byte before it.

The engine uses it for the hand-over lead on a NIC in-link (meshjob_trainer.engine): the next large
receive of the same transfer may be posted once the one in flight has only its last `lead_bytes` to
take, by its buffer, not by a clock started at its post. The clock is right when the sender starts at
once, but a sender busy with an earlier message (or a forwarder still waiting for its own chunk) starts
late, and a receive posted beside it lets a second sender share the in-link with the first.

The markers sit at the lead point (the last word before the last lead_bytes) and every half lead below
it (at most MAX_MARKERS). The first marker still in place bounds how soon the rest can be in (at the
NIC's rate), so the engine sleeps until then and looks again (at most a half lead early; no sooner than
an eighth of a lead, where the bytes are between the last two markers). A payload word equal to the
random marker (one chance in 2^64 per word) reads as not yet landed: the next receive is then posted
when this one completes, as without a lead, and nothing is lost.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

MARKER = int.from_bytes(os.urandom(8), "little", signed=True)  # one per process; any value works
MAX_MARKERS = 64


@dataclass(frozen=True)
class LandingProbe:
    words: torch.Tensor  # the receive buffer as int64 words (a view: the payload overwrites the markers)
    index: torch.Tensor  # the marked words, ascending
    nbytes: int

    @classmethod
    def place(cls, buffer: torch.Tensor, lead_bytes: int) -> LandingProbe | None:
        """Mark `buffer` (before its receive is posted). None where it cannot be read as it lands (not a
        contiguous CPU tensor of whole, aligned 8-byte words) or is no longer than the lead."""
        nbytes = buffer.numel() * buffer.element_size()
        if (
            buffer.device.type != "cpu"
            or not buffer.is_contiguous()
            or nbytes % 8
            or buffer.data_ptr() % 8
            or not 0 < lead_bytes < nbytes
        ):
            return None
        try:
            words = buffer.view(-1).view(torch.uint8).view(torch.int64)
        except RuntimeError:  # a view this dtype cannot take (e.g. an odd storage offset)
            return None
        step = max(1, lead_bytes // 16)  # half a lead, in words
        top = (nbytes - lead_bytes - 1) // 8  # the last word wholly before the lead: once it is in, the lead has come
        index = torch.arange(top, -1, -step)[:MAX_MARKERS].flip(0)
        if index[0] != 0:
            index = torch.cat([torch.zeros(1, dtype=index.dtype), index])  # the first word: none landed yet
        words[index] = MARKER
        return cls(words, index, nbytes)

    def due_in_s(self, nic_bytes_per_s: float) -> float:
        """The soonest the whole message can be in, at the NIC's rate: its bytes have not reached the
        first marker still in place. Past the lead point (every marker overwritten), what is left of it."""
        waiting = (self.words[self.index] == MARKER).nonzero()
        edge = int(self.index[-1]) + 1 if waiting.numel() == 0 else int(self.index[waiting[0, 0]])
        return (self.nbytes - 8 * edge) / nic_bytes_per_s
