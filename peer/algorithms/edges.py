"""One undirected gossip edge: the public copies both ends keep, and the rules that keep them
identical and the mixing symmetric.

CHOCO-SGD (Koloskova, Stich, Jaggi, ICML 2019) lets every peer keep *public copies* x̂ of its
neighbours' models, updated only by compressed increments q. We keep one pair per edge:

* ``public``: x̂_{i->j}, what j believes of x_i. i sends q = Q(x_i - x̂_{i->j}).
* ``mirror``: i's copy of x̂_{j->i}.

The invariant: i's ``mirror`` equals j's ``public`` bit for bit, and both ends mix the same
copies with the same weight, so the swarm's average is preserved. Three rules carry it:

1. **Sessions.** Both directions of an edge run in one session, named by an epoch that the
   edge's *leader* (the end with the smaller id) picks: unique and increasing per leader, so a
   restarted or reset leader's new session always has a larger one. A session opens with an INIT
   or RESYNC (seq 1) in each direction and numbers its updates 1, 2, ... Any inconsistency (a
   gap, a checksum mismatch, a refused update, an update of an older session, a restarted
   neighbour) ends the session: the leader opens a new one, the follower drops its state and
   waits for it (asking with a *hello*, an update of epoch 0, if it has none). So the streams of
   an old and a new session are never taken for one another.
2. **Exchanges.** Update n of one direction pairs with update n of the other: exchange n. An
   end mixes exchange n once, only when its own update n was acknowledged and the neighbour's
   update n was applied, and sends update n + 1 only after that. So both ends mix exchange n with
   the copies as of exchange n, whatever their round counters say (rounds are labels, not a
   clock), and a failed push is never mixed: it is retried, the same bytes under the same seq.
3. **Agreed weights.** Each update carries the weight its sender proposes from its own view of
   the swarm; exchange n is mixed with the smaller proposal at both ends (0: not mixed), so two
   peers with different membership views never mix one-sidedly.

An update that arrives one exchange early (the neighbour mixed exchange n before we did) is held
until we mixed n. A held update counts as received, and there is never more than one.

The end of a run keeps rule 2 too. An end that finishes promises, in its FINAL notice, the
last exchange it opened (``sent``), and from then on acknowledges only updates of exchanges up
to that one (``last``): any other is answered FINISHED (applied if it is this session's next,
so the copies stay identical, but never acknowledged; a hello or another session's update
changes nothing). When it stops waiting it decides each edge at once, under the edge's lock:
an exchange complete at this end is mixed, any other never is, and ``last`` drops to what was
mixed, so the neighbour's late update gets FINISHED instead of an acknowledgement. The
neighbour takes a FINAL notice, or a FINISHED answer to update n (the exchange before it,
n - 1), as the last exchange the edge completes (``ended`` once that one is mixed): it opens
nothing beyond it and waits for nothing beyond it. An exchange mixes only with both updates
acknowledged, so one that crosses the FINAL is mixed at both ends or at none.
"""

from __future__ import annotations

import enum
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from gossipgrad.compression import Codec, DecodeError
from gossipgrad.peer.flat import SpilledTensor, tensor_checksum

_last_epoch = 0
_epoch_lock = threading.Lock()

#: A neighbour's word ends a session of its edge at most once per this many seconds for each
#: of two causes: a hello (a leader opens a new session for it) and an update that fails a
#: check (a gap, a bad checksum, an undecodable payload; either end). Each new session costs
#: a dense resync (built under the training lock) and breaks the exchange in flight: a
#: neighbour saying hello, or sending bad updates, in a loop would otherwise keep the edge
#: from ever mixing and cost the training thread a resync each time. An honest follower says
#: hello once per session it lost, and honest updates fail a check rarely; one more within
#: the interval waits (a hello is said again each round until the leader's opening comes; a
#: failed check is answered LIMITED and the session ends once the interval has passed).
HELLO_RESTART_INTERVAL = 5.0
#: Seconds a push refused for now (RESOURCE_EXHAUSTED: the other end's session is due to end
#: within HELLO_RESTART_INTERVAL, or it is busy) waits before the same update goes again. A
#: round's wait pushed it again at every wake-up before: some 2,000 refused pushes, and as
#: many warnings, in one interval on a loaded host.
REFUSED_RETRY_S = 0.25


def new_epoch() -> int:
    """A session epoch unique and increasing within this process, and larger than any epoch an
    earlier run of it made (nanoseconds of wall-clock time, bumped past the last one)."""
    global _last_epoch
    with _epoch_lock:
        _last_epoch = max(time.time_ns(), _last_epoch + 1)
        return _last_epoch


class Verdict(enum.Enum):
    """What the receiver did with an incoming update."""

    ACCEPTED = "accepted"
    DUPLICATE = "duplicate"
    NEED_RESYNC = "need_resync"
    FINISHED = "finished"  # this end finished: the update is never acknowledged or mixed
    LIMITED = "limited"  # failed a check; the session ends once HELLO_RESTART_INTERVAL allows


class Kind(enum.Enum):
    """How an update changes the mirror."""

    INIT = "init"  # the shared initial model (no payload)
    RESYNC = "resync"  # a dense copy
    DELTA = "delta"  # a compressed increment


@dataclass(frozen=True)
class Copies:
    """How an edge's copies are coded: the codec of its increments, the dense one of its
    resyncs, the shared initial value of its INIT openings (kept in a file: read only when an
    edge opens), and error feedback on or off."""

    codec: Codec
    dense: Codec
    initial: SpilledTensor
    error_feedback: bool = True
    #: The copies' dtype. Narrower than the model's (float16) halves their memory: every
    #: increment is rounded to it the same way at both ends, so the copies stay identical,
    #: and what rounding drops stays in x − x̂, which error feedback sends later.
    dtype: torch.dtype = torch.float32


@dataclass
class Incoming:
    """An update as the edge sees it (decoded lazily by ``apply``)."""

    epoch: int
    seq: int
    kind: Kind
    checksum: int
    weight: float
    payload: Any = None
    dropped: int = 0  # a hello's dropped_epoch


#: A push deadline grows at most 2**MAX_DOUBLINGS-fold (64 x the configured push_timeout).
MAX_DOUBLINGS = 6


@dataclass
class Edge:
    """Both directions of edge i <-> j, as seen from i. Every method expects ``lock`` held."""

    public: torch.Tensor
    mirror: torch.Tensor
    leader: bool  # this end picks the session epoch
    epoch: int = 0  # the session (0: a follower waiting for the leader's next one)
    # out direction (i -> j)
    sent: int = 0  # updates folded into `public` in this session
    acked: int = 0  # of those, confirmed by j
    unacked: Any = None  # the last update (header, payload) until it is acknowledged
    proposed: float = 0.0  # our weight proposal for exchange `sent`
    opened_round: int = 0  # the gossip round that opened exchange `sent` (max_staleness)
    last_sent: torch.Tensor | None = None  # error feedback off: x at the last send
    residual: float = float("nan")  # ||x − public|| after our last update (error feedback)
    public_checksum: int | None = None  # tensor_checksum(public) after our last update
    busy: bool = False  # a push is in flight
    timeouts: int = 0  # pushes in a row that ran past their deadline (each doubles the next)
    retry_at: float = 0.0  # monotonic time before which a refused-for-now push waits
    idle: threading.Event = field(default_factory=threading.Event)
    # in direction (j -> i)
    received: int = 0  # j's updates applied to `mirror` in this session
    peer_weight: float = 0.0  # j's proposal for exchange `received`
    held: Incoming | None = None  # j's update `received + 1`, early
    # both
    mixed: int = 0  # exchanges mixed
    requested: bool = False  # the follower asked for a session: open one even off-schedule
    restarts: int = 0  # sessions ended (the next opening is then a RESYNC, never an INIT)
    # when a session was last ended by each cause ("hello", "check"): ``_may_restart``
    restarted_at: dict[str, float] = field(default_factory=dict)
    restart_due: bool = False  # an update failed a check; the restart waits for the interval
    dropped: int = 0  # a follower: the latest of the leader's sessions it dropped
    # j finished: (its session, the last exchange it completes). Keyed by session, so a
    # notice that overtook the opening of its session applies once the follower joins it.
    final: tuple[int, int] | None = None
    # i finished: the last exchange of this session it takes part in (None: still running).
    last: int | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.idle.set()
        if self.leader and self.epoch == 0:
            self.epoch = new_epoch()

    # ------------------------------------------------------------------ sessions

    def restart(self) -> None:
        """End the session in both directions: a leader opens a new one at once, a follower
        waits for the leader's (and says hello)."""
        if not self.leader:
            self.dropped = max(self.dropped, self.epoch)
        if self.final is not None and self.final[0] <= self.epoch:
            self.final = None  # about the session that ended
        self.epoch = new_epoch() if self.leader else 0
        self._zero()
        self.restarts += 1
        if self.last is not None:
            self.last = 0  # finished: nothing of a new session is taken

    def _zero(self) -> None:
        self.sent = self.acked = self.received = self.mixed = 0
        self.unacked = None
        self.held = None
        self.restart_due = False

    def fail(self) -> Verdict:
        """An update of this session failed a check (a gap, a bad checksum, an undecodable
        payload): end the session (NEED_RESYNC), or, if the neighbour's word ended one less
        than ``HELLO_RESTART_INTERVAL`` ago, mark it due and answer LIMITED. A session due to
        end sends, applies and acknowledges nothing more (its mirror may hold the bad
        update); ``restart_if_due`` ends it once the interval has passed."""
        if self._may_restart("check"):
            self.restart()
            return Verdict.NEED_RESYNC
        self.restart_due = True
        return Verdict.LIMITED

    def restart_if_due(self) -> None:
        """End the session if a failed check asked for it and the interval now allows."""
        if self.restart_due and self._may_restart("check"):
            self.restart()

    @property
    def valid(self) -> bool:
        """The mirror holds the neighbour's public copy of this session (as of ``received``)."""
        return self.epoch != 0 and self.received > 0

    @property
    def fresh(self) -> bool:
        """Nothing of this session exchanged yet beyond (at most) our opening."""
        return self.sent <= 1 and self.acked == 0 and self.received == 0

    def describe(self) -> str:
        """The edge's state in one line: its session and where each direction stands."""
        return (
            f"{'leader' if self.leader else 'follower'} session {self.epoch}, sent {self.sent} "
            f"acked {self.acked} received {self.received} mixed {self.mixed}"
            f"{', push in flight' if self.busy else ''}"
            f"{', held' if self.held is not None else ''}"
            f"{', asked for a session' if self.requested else ''}, restarts {self.restarts}"
        )

    # ------------------------------------------------------------------ sending

    def can_send(self) -> bool:
        """Update ``sent + 1`` may go out: exchange ``sent`` is mixed, no push in flight, and
        neither end finished before exchange ``sent + 1``."""
        bound = min(
            (b for b in (self.last, self.peer_final) if b is not None), default=self.sent + 1
        )
        return (
            self.epoch != 0
            and not self.restart_due
            and not self.busy
            and self.unacked is None
            and self.sent == self.mixed
            and self.sent < bound
        )

    def record_sent(self, update: Any, weight: float, round: int) -> int:
        """Update ``sent + 1`` was folded into ``public`` in gossip round ``round``; keep it
        until acknowledged."""
        self.sent += 1
        self.unacked = update
        self.proposed = weight
        self.opened_round = round
        self.requested = False
        return self.sent

    def mark_sent(self, x: torch.Tensor) -> None:
        """Remember x as the base of the next difference (error feedback off)."""
        if self.last_sent is None:
            self.last_sent = x.clone()
        else:
            self.last_sent.copy_(x)

    def delta_key(self, c: Copies, seed: int) -> tuple[int, int] | None:
        """What the next update depends on besides x, if it is a DELTA of x − x̂: the codec's
        ``seed`` (the round's, the same for every edge) and x̂'s checksum. Two edges with the
        same key, encoding the same x, send the same bytes and move x̂ alike
        (``take_update``). None for an opening or a RESYNC, and without error feedback (then
        the base is the edge's own last x)."""
        if self.sent == 0 or not c.error_feedback or self.public_checksum is None:
            return None
        return seed, self.public_checksum

    def take_update(self, public: torch.Tensor, residual: float) -> None:
        """Fold in the update another edge with our ``delta_key`` made this round: its
        public copy after it (ours plus the same bytes) and what it left to send."""
        self.public.copy_(public)
        self.residual = residual

    def opens_dense(self, early: bool) -> bool:
        """The next update is a RESYNC opening (``encode_next``)."""
        return self.sent == 0 and not (self.restarts == 0 and early)

    def encode_next(
        self,
        x: torch.Tensor,
        c: Copies,
        early: bool,
        seed: int,
        scratch: torch.Tensor | None = None,
        resync_from: tuple[torch.Tensor, float] | None = None,
    ) -> tuple[Kind, bytes]:
        """The next update of this edge, folded into ``public``: the session's opening (INIT
        while ``early`` and this edge never restarted, peers sharing the seeded initial model;
        else a dense RESYNC), or q = Q(x − x̂) with the codec's ``seed`` (error feedback off:
        Q(x − b), b being x at the previous send). Checksum and seq are the caller's to stamp.

        A RESYNC sends x, or with ``resync_from`` (another edge's public copy and its
        ||x − x̂||, updated this round) that copy: CHOCO's one x̂ for all neighbours, so that
        this edge is in sync with that one from the next round on and sends its updates
        without encoding them again (what x − x̂ holds is sent later, as error feedback's).

        ``scratch``: a buffer of x's shape and dtype for the difference of a sparse codec
        (one per round, so the edges of a round share one model-sized temporary; a dense
        codec encodes the difference a chunk at a time and needs none). ``residual`` becomes
        ||x − x̂|| after the update, measured by the encoder."""
        if self.opens_dense(early):
            if resync_from is None:
                self.public.copy_(x)
                self.residual = 0.0
            else:
                self.take_update(*resync_from)
            kind, payload = Kind.RESYNC, c.dense.encode(self.public)
        elif self.sent == 0:
            c.initial.copy_to(self.public)
            kind, payload = Kind.INIT, b""
            self.residual = float("nan")
        else:
            base = self.public if c.error_feedback or self.last_sent is None else self.last_sent
            # What the encoder built is applied to x̂ as the receiver's decode_add_ applies
            # the bytes, bit for bit, without decoding them: folded in as it encodes where
            # x̂ is the base (a dense codec's chunk while in cache), else after.
            fold = base is self.public
            payload, sent, left = c.codec.encode_difference(
                x, base, seed=seed, scratch=scratch, fold=fold
            )
            if not fold:
                sent.add_to_(self.public)
            # What stays to send: ||x − x̂|| = ||(x − x̂_before) − decode(q)||.
            self.residual = left if c.error_feedback else float("nan")
            kind = Kind.DELTA
        if not c.error_feedback:
            self.mark_sent(self.public if kind is not Kind.DELTA else x)
        return kind, payload

    def apply(self, update: Incoming, c: Copies) -> Verdict:
        """Fold an admitted update into ``mirror`` and verify it (``finish``). Raises
        DecodeError for a payload that does not decode to this edge's shape."""
        if update.kind is Kind.INIT:
            c.initial.copy_to(self.mirror)
        elif update.kind is Kind.RESYNC:
            shape, dtype = c.dense.inspect(update.payload, max_numel=self.mirror.numel())
            if shape != tuple(self.mirror.shape):
                raise DecodeError(
                    f"resync of {math.prod(shape)} values, expected {self.mirror.numel()}"
                )
            if dtype != self.mirror.dtype:
                raise DecodeError(
                    f"resync of {dtype} copies, ours are {self.mirror.dtype}: "
                    "gossip.copy_dtype must be the same at every peer"
                )
            # Straight into the mirror: no model-sized decoded copy beside the payload.
            c.dense.decode(update.payload, out=self.mirror)
        else:
            c.codec.decode_add_(update.payload, self.mirror, cast=True)
        return self.finish(update)

    def patience(self) -> float:
        """How many push deadlines the next push may take: doubled after each push that ran
        out of time, so a dense resync over a link slower than one deadline gets through
        instead of being cut off and sent again forever."""
        return float(2 ** min(self.timeouts, MAX_DOUBLINGS))

    def claim(self) -> bool:
        """Mark a push in flight; False if one already is."""
        if self.busy:
            return False
        self.busy = True
        self.idle.clear()
        return True

    def release(self) -> None:
        """The push finished, whatever its outcome."""
        self.busy = False
        self.idle.set()

    def refused_for_now(self) -> None:
        """The push was refused for now (RESOURCE_EXHAUSTED): the same update waits
        :data:`REFUSED_RETRY_S` before it goes again."""
        self.retry_at = time.monotonic() + REFUSED_RETRY_S

    def may_retry(self) -> bool:
        """Whether the unacknowledged update may go again now."""
        return time.monotonic() >= self.retry_at

    def answered(self, epoch: int, seq: int, verdict: Verdict) -> None:
        """j answered our update ``seq`` of session ``epoch`` (ignored if that session is over;
        a FINISHED answer to a hello, epoch 0, ends the edge while we have no session)."""
        if epoch != self.epoch or (epoch == 0 and verdict is not Verdict.FINISHED):
            return
        if verdict is Verdict.NEED_RESYNC:
            self.restart()
        elif verdict is Verdict.FINISHED:
            # Not applied: the exchange is never mixed, and neither is any later one.
            self.note_final(epoch, max(seq - 1, 0))
            if seq == self.sent:
                self.unacked = None
        elif seq == self.sent:
            self.acked = seq
            self.unacked = None

    # ------------------------------------------------------------------ receiving

    def admit(self, update: Incoming) -> Verdict | None:
        """Session and sequence checks on arrival: None to apply now, or the verdict.

        An update one exchange early is held (ACCEPTED). An update out of order ends the
        session (NEED_RESYNC); one of an older session only gets NEED_RESYNC back. Once this
        end finished, a hello or an update of another session gets FINISHED and changes
        nothing (``reply`` says what an update of this session gets).
        """
        if self.last is not None and (update.epoch != self.epoch or update.epoch == 0):
            return Verdict.FINISHED
        if update.epoch == 0:  # a follower's hello: it has no session with us
            if self.leader:
                # It dropped our session, or it took part in it (we applied its updates) and
                # lost it: a restarted process, which remembers no session. Either way open a
                # new one now. (A hello naming an older session while our opening is on its
                # way changes nothing: its updates come after that push, never before.)
                lost = update.dropped >= self.epoch or self.received > 0
                if lost and self._may_restart("hello"):
                    self.restart()
                self.requested = True
            return Verdict.NEED_RESYNC
        if update.epoch != self.epoch:
            if self.leader or update.epoch < self.epoch:
                return Verdict.NEED_RESYNC  # an old session
            if update.seq != 1 or update.kind is Kind.DELTA:
                return self.fail()  # the leader's new session, but we missed its opening
            self.epoch = update.epoch  # the leader opened a new session: follow it
            self._zero()
        if self.restart_due:
            return self.fail()  # an earlier update of this session failed a check
        if update.seq <= self.received or (self.held is not None and update.seq == self.held.seq):
            return Verdict.DUPLICATE  # a retry of one we have: acknowledged again
        opening = update.kind is not Kind.DELTA
        if update.seq != self.received + 1 or opening != (update.seq == 1):
            return self.fail()  # a gap, or a session that opens twice
        if self.received > self.mixed:
            if self.held is not None:
                return self.fail()  # two exchanges ahead: rule 2 broken
            self.held = update
            return Verdict.ACCEPTED
        return None

    def _may_restart(self, cause: str) -> bool:
        """Whether a ``cause`` ("hello" or "check") may end a session now: not within
        ``HELLO_RESTART_INTERVAL`` of the last it ended; if so, its interval starts again.
        Each cause has its own, so an honest edge's hello and a check failing right after it
        (peers whose INIT copies differ) both take effect at once."""
        now = time.monotonic()
        if now - self.restarted_at.get(cause, float("-inf")) < HELLO_RESTART_INTERVAL:
            return False
        self.restarted_at[cause] = now
        return True

    def note_final(self, epoch: int, seq: int) -> None:
        """j completes no exchange beyond ``seq`` of session ``epoch`` (its FINAL notice, or
        its FINISHED answer; ignored for an older session). Each says "at most", so the
        smaller of two for one session holds.

        A follower may hear it before the opening of that session: the leader's FINAL and its
        last update travel as separate pushes. The notice is then kept and takes effect when
        the follower joins the session, or it would wait for exchanges the leader never opens.
        """
        if epoch < self.epoch:
            return
        if self.final is not None and self.final[0] == epoch:
            seq = min(seq, self.final[1])
        self.final = (epoch, seq)

    @property
    def peer_final(self) -> int | None:
        """The last exchange j completes in this session, if it said it finished."""
        if self.final is not None and self.final[0] == self.epoch:
            return self.final[1]
        return None

    @property
    def ended(self) -> bool:
        """j finished and every exchange it completes is mixed here: nothing more to open,
        push, wait for or mix on this edge."""
        final = self.peer_final
        return final is not None and self.mixed >= final

    def close(self, last: int) -> None:
        """This end finished: it takes part in no exchange of this session beyond ``last``."""
        self.last = last if self.last is None else min(self.last, last)

    def reply(self, update: Incoming, verdict: Verdict) -> Verdict:
        """What the sender is told of an update taken with ``verdict``: once this end
        finished, FINISHED for an exchange beyond ``last``. Such an update is still applied
        (the copies stay identical) but never acknowledged, so it is mixed at neither end."""
        if self.last is not None and update.seq > self.last and verdict is not Verdict.NEED_RESYNC:
            return Verdict.FINISHED
        return verdict

    def finish(self, update: Incoming) -> Verdict:
        """After the update was applied to ``mirror``: verify the checksum and advance."""
        if tensor_checksum(self.mirror) != update.checksum:
            return self.fail()
        self.received = update.seq
        self.peer_weight = update.weight
        return Verdict.ACCEPTED

    # ------------------------------------------------------------------ mixing

    def outstanding(self) -> bool:
        """We sent an update whose exchange is not mixed yet."""
        return self.sent > self.mixed

    def owed(self) -> bool:
        """j is waiting for us: it opened an exchange we have not answered, or asked for a
        session."""
        return self.requested or self.received > self.sent

    def exchange_ready(self) -> bool:
        """Exchange ``mixed + 1`` is complete at this end: ours acknowledged, theirs applied."""
        e = self.mixed + 1
        return self.acked >= e and self.received >= e and (self.last is None or e <= self.last)

    def weight(self) -> float:
        """The agreed weight of the ready exchange (rule 3)."""
        return min(self.proposed, self.peer_weight)

    def done_mixing(self) -> Incoming | None:
        """Exchange ``mixed + 1`` was mixed; returns the held update, now due."""
        self.mixed += 1
        held, self.held = self.held, None
        return held


class EdgeTable(dict):
    """A peer's edges by neighbour id, made on first use.

    It also remembers, per neighbour, the newest of the leader's sessions that a pruned
    follower edge took part in: the edge made again names it in its hello (rule 1), so the
    leader ends that session rather than wait in it forever for an answer this end can no
    longer give (a peer that took a leader's opening before its membership knew the leader
    prunes the edge at its next view change).
    """

    def __init__(self, like: torch.Tensor, me: str, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self._like = like
        self._dtype = like.dtype if dtype is None else dtype
        self._me = me
        self._dropped: dict[str, int] = {}
        self._lock = threading.Lock()
        self.closed = False  # this end finished (``close``)

    def edge(self, peer: str) -> Edge:
        """The edge with ``peer`` (made now if there is none)."""
        with self._lock:
            e = self.get(peer)
            if e is None:
                e = self[peer] = Edge(
                    public=torch.zeros_like(self._like, dtype=self._dtype),
                    mirror=torch.zeros_like(self._like, dtype=self._dtype),
                    leader=self._me < peer,
                    dropped=self._dropped.pop(peer, 0),
                    last=0 if self.closed else None,
                )
            return e

    def close(self) -> None:
        """This end finished: each edge takes part in no exchange beyond the last one it
        opened, and an edge made from now on in none (atomic with making edges, so no edge
        slips through between the two)."""
        with self._lock:
            self.closed = True
            for e in self.values():
                with e.lock:
                    e.close(e.sent)

    def restart(self, peer: str) -> None:
        """End the session with ``peer`` (if there is an edge)."""
        e = self.get(peer)
        if e is not None:
            with e.lock:
                e.restart()

    def prune(self, present: set[str]) -> None:
        """Drop the edges of peers not in ``present``."""
        with self._lock:
            for peer in [p for p in self if p not in present]:
                e = self.pop(peer)
                if not e.leader:
                    with e.lock:
                        self._dropped[peer] = max(e.dropped, e.epoch)
