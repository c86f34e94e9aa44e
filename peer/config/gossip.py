"""The ``[gossip]`` section: which algorithm, codec and topology, and their step sizes."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from gossipgrad.peer.config.base import Section
from gossipgrad.peer.config.recommended import RECOMMENDED, default_for
from pydantic import Field, field_validator, model_validator


class GossipSection(Section):
    """How peers exchange and merge models (Koloskova et al., ICML 2019: CHOCO-SGD)."""

    # The keys with ``default_for`` take the chosen algorithm's recommended value when left
    # unset (peer/config/recommended.py); a key set explicitly keeps its value.

    algorithm: Literal["choco", "ef-gradient", "diloco", "exact-diloco"] = Field(
        "choco",
        description="choco: compressed model gossip with public copies (default). "
        "ef-gradient: compressed gradient exchange with error feedback, plus choco gossip "
        "every consensus_every rounds to keep models together. diloco: phases of "
        "local_steps inner steps, error-feedback-compressed pseudo-gradients averaged over "
        "the neighbours, an outer SGD step on an anchor (outer_lr, outer_momentum), and choco "
        "gossip that keeps the anchors together (for AdamW transformers; docs/algorithms.md). "
        "exact-diloco: diloco's phases, but every peer's error-feedback-compressed "
        "pseudo-gradient is forwarded along spanning trees of the topology to every peer, and "
        "every peer takes the outer step on their exact mean: identical replicas, no anchor "
        "gossip, about n-1 messages uploaded per peer and phase.",
    )
    codec: str = Field(
        default_factory=default_for("codec"),
        description="Compression spec, e.g. none, fp16, int8, int4, sign, qsgd:16, "
        "topk:0.01, randomk:0.01, topk:0.01+int8 (docs/compression.md). Per algorithm; "
        "diloco: it compresses the pseudo-gradients, with error feedback (char transformer, "
        "4 peers, H = 10: dense 1.72 at 587 MB per peer, top-20% + int2 1.76 at 30 MB).",
    )
    topology: str = Field(
        default_factory=default_for("topology"),
        description="ring, torus, full, random-regular, exponential, one-peer-exponential "
        "(docs/topologies.md). Per algorithm; diloco: the exponential graph, on which each "
        "peer averages with every other up to 5 peers and with about 2 log2 n beyond (its "
        "phases are rare, so hearing more peers costs few bytes per step; docs/algorithms.md).",
    )
    degree: int | None = Field(
        None,
        ge=2,
        description="Degree of the random-regular topology (empty: 3); other topologies "
        "have a fixed shape and reject it.",
    )
    gamma: float = Field(
        0.03,
        gt=0,
        le=1,
        description="CHOCO consensus step size: x_i += gamma * sum_j w_ij (xhat_j - xhat_i). "
        "Stability needs it small against the codec's precision (Koloskova et al. 2019): "
        "with topk:0.01 on digits, 0.1 drifted apart over a few thousand rounds while 0.03 "
        "stayed in consensus; dense-ish codecs (fp16, int8) tolerate 0.5.",
    )
    local_steps: int = Field(
        default_factory=default_for("local_steps"),
        ge=1,
        description="Optimizer steps between gossip rounds (H); diloco: inner steps per phase. "
        "Per algorithm; diloco's quality falls and its bytes fall as 1/H (H = 5 / 10 / 20 / "
        "50 ended 6 / 10 / 14 / 19 % above DDP on the char transformer).",
    )
    qsr_alpha: float = Field(
        0.0,
        ge=0,
        description="exact-diloco: let phases grow as the learning rate decays (Quadratic "
        "Synchronization Rule, Gu et al., ICLR 2024): after a phase end at learning rate lr, "
        "the next phase lasts max(local_steps, floor((qsr_alpha / lr)^2)) inner steps; while "
        "the learning rate rises (warm-up) phases stay at local_steps. 0: off. "
        "qsr_alpha = peak lr x sqrt(H) makes phases longer than H once the lr falls below "
        "its peak; docs/algorithms.md.",
    )
    outer_lr: float = Field(
        default_factory=default_for("outer_lr"),
        gt=0,
        le=2,
        description="diloco: outer learning rate. 1 with outer_momentum 0 is plain periodic "
        "averaging, which beat DiLoCo's 0.7 with Nesterov 0.9 (Douillard et al. 2023, tuned "
        "for H = 500 from a pretrained model) on the char transformer trained from scratch, "
        "4 and 8 peers (BENCHMARKS.md); 0.8 and 1.3 were worse than 1.",
    )
    outer_momentum: float = Field(
        default_factory=default_for("outer_momentum"),
        ge=0,
        lt=1,
        description="diloco: outer momentum (0: none; DiLoCo's 0.9 carried each phase's "
        "neighbourhood difference on for ~10 phases and lost 20-30% validation loss).",
    )
    outer_nesterov: bool = Field(
        True,
        description="diloco: Nesterov momentum in the outer step when outer_momentum > 0 "
        "(false: heavy ball).",
    )
    anchor_codec: str = Field(
        default_factory=default_for("anchor_codec"),
        description="diloco: codec of the CHOCO gossip that keeps the anchors together (codec "
        "compresses the pseudo-gradients). An anchor moves densely once a phase, so it needs "
        "a dense codec precise enough for a large anchor_gamma: 1-bit sign did as well as "
        "int2 at 80% of its bytes, top-k anchors drifted apart.",
    )
    anchor_topology: str = Field(
        default_factory=default_for("anchor_topology"),
        description="diloco: the graph of the anchors' CHOCO gossip (the pseudo-gradients are "
        "averaged over topology). Each of its edges keeps two anchor copies (2 c M per edge, "
        "docs/scale.md) where an averaging edge keeps none, so a dense topology with a ring "
        "for the anchors hears many peers at a ring's memory. The same names as topology "
        "(random-regular: degree 3).",
    )
    background_rounds: bool = Field(
        False,
        description="choco, diloco: run each round (encode, pushes, waits, mixing) on a thread "
        "of its own while training computes the next steps; the training thread waits only for "
        "the round before, when the next is due. Needs a core free for gossip. choco: a "
        "round's mixing lands a few steps after the step it started from (CHOCO tolerates "
        "such delay, as it does max_staleness). diloco: the round's thread first keeps a copy "
        "of the parameters at the phase's end (one model more) while training computes the "
        "next step's gradients (its optimizer step waits for the copy); when the round is "
        "over the parameters move by what the anchor moved from that copy, keeping the "
        "progress made meanwhile. Not with overlap.",
    )
    state_device: Literal["auto", "model", "host"] = Field(
        "auto",
        description="Where the gossip state (copies, residuals, anchors, messages) lives. "
        "host: in host memory (pinned where CUDA is), built on a host copy of the "
        "parameters that takes them before each round and gives them back after it (two "
        "copies of the model across the bus per round; no model-sized gossip buffer on the "
        "accelerator); choco, diloco and exact-diloco, without background_rounds. model: on "
        "the model's device. auto: host for a model on an accelerator where host can be "
        "used, else model (a CPU model needs no second copy); logged.",
    )
    copy_dtype: Literal["float32", "float16"] = Field(
        default_factory=default_for("copy_dtype"),
        description="Precision of the public copies CHOCO keeps per edge (two per edge: "
        "choco's of the parameters, diloco's of the anchors). float16 halves their memory: "
        "both ends round every increment alike, so an edge's copies stay identical, and what "
        "rounding drops (2^-11 of a value) stays in x − x̂ for error feedback to send later. "
        "Every peer of a swarm must use the same.",
    )
    buffers: Literal["average", "local"] = Field(
        "average",
        description="A model's floating-point buffers (BatchNorm running statistics): average "
        "them with the neighbours after every round (plain gossip averaging, beside any "
        "algorithm), or keep each peer's own. Integer buffers stay local.",
    )
    buffers_every: int = Field(
        10,
        ge=1,
        description="Average the buffers every N gossip rounds. Running statistics move "
        "slowly (BatchNorm's momentum 0.1 averages about 10 batches), and sending them every "
        "round cost 23% more bytes than the parameters' top-1% gossip on the BatchNorm CNN.",
    )
    buffer_codec: str = Field(
        "none",
        description="Codec of the buffers' messages (none: dense fp32; they are small). "
        "Buffers are sent whole each round, so error feedback does not apply.",
    )
    anchor_gamma: float = Field(
        default_factory=default_for("anchor_gamma"),
        gt=0,
        le=1,
        description="diloco: consensus step of the anchors' CHOCO gossip (0.5 with int8 held "
        "4 peers on digits at 3.6e-6 relative consensus distance; 0.03 with top-1% let them "
        "drift apart).",
    )
    overlap: bool | Literal["auto"] = Field(
        False,
        description="diloco: exchange a phase's pseudo-gradient while the next phase "
        "computes, applying it one phase late (hides a WAN round trip behind compute; on "
        "local links it cost the char transformer 1.96 against 1.76 of loss). auto: off, "
        "turned on for the run once the measured round trip (the least of the latest pushes) "
        "is 10 ms or more and over a quarter of a phase's compute (the median of the latest "
        "phases), after 3 phases; logged and in status.json (peer/algorithms/phase_overlap.py). "
        "Not the default: 4 digits sites at 100 ms RTT stepped 16 % faster with it but ended "
        "0.8 points lower, and with max_staleness 2 for the anchors 4.6 points lower "
        "(BENCHMARKS.md).",
    )
    consensus_every: int = Field(
        1,
        ge=1,
        description="ef-gradient: local steps between CHOCO model-gossip rounds that keep the "
        "models together (1-2 measured best on digits; 4 and more lost accuracy).",
    )
    ef_momentum: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="ef-gradient: DGC momentum correction (Lin et al. 2018), the momentum "
        "folded into the compressed gradient; use it with a momentum-free local optimizer "
        "(0: off).",
    )
    error_feedback: bool = Field(
        True,
        description="Keep what the codec drops and send it later (error feedback). false is "
        "the ablation without it, where dropped information is lost for good. choco: each "
        "edge sends q = Q(x - b), b being x at the previous send on that edge (DCD-PSGD "
        "difference compression without memory, Tang et al. 2018) instead of "
        "Q(x - xhat), so xhat drifts away from x; costs one more model-sized copy per "
        "out-edge. ef-gradient: c = Q(g) with no residual, and its choco consensus rounds "
        "drop error feedback as above. Both ends of an edge stay identical either way.",
    )
    final_rounds: int = Field(
        0,
        ge=0,
        description="Gossip-only rounds after the last training step (no gradients, the "
        "same codec): the peers' models move towards their average, so each site ends "
        "closer to the swarm's consensus. Every peer of a swarm must use the same value. "
        "Pure consensus: keep gamma in the range where gossip alone converges "
        "(scripts/bench_consensus.py; 0.03 with top-1%, not 0.1).",
    )
    max_staleness: Annotated[int, Field(ge=0, le=64)] | Literal["auto"] = Field(
        "auto",
        description="0: each round waits for the exchanges it opens (lock-step). 1: an "
        "exchange opened in one round is waited for and mixed in the next, so compute "
        "overlaps communication. k > 1: a round waits only for exchanges opened k rounds "
        "before; an edge carries one exchange at a time, so a link whose round trip is "
        "longer than a round mixes every few rounds (at most k apart) instead of pacing "
        "the peers at its ends: for WAN links slower than a training step. auto: chosen "
        "from the measured round trip (the least of the latest pushes) and compute per "
        "round (the median of the latest rounds): ceil(round trip / compute), at most 4; "
        "1 while the round trip is under 10 ms, at most a quarter of a round's compute, "
        "or not yet measured; revisited every 16 rounds, logged and in status.json "
        "(peer/algorithms/staleness.py; docs/algorithms.md). Both ends of an edge mix the "
        "same copies either way; waiting is bounded by round_timeout.",
    )
    round_timeout: float = Field(
        10.0, gt=0, description="Seconds to wait for a lagging neighbour before suspecting it."
    )
    robust_clip: float = Field(
        0.0,
        ge=0,
        description="Robust merging against a faulty or malicious neighbour: clip each "
        "neighbour's pull xhat_j - xhat_i to this L2 norm before mixing (self-centred "
        "clipping, He, Karimireddy, Jaggi 2022, ClippedGossip). 0: off (plain CHOCO). Set it "
        "to a few times the usual gossipgrad_consensus_distance; see SECURITY.md.",
    )

    def chosen_defaults(self) -> dict[str, Any]:
        """The keys this section took from its algorithm's recommended values (left unset
        by the user), with those values; what the daemon logs and writes in status.json."""
        return {
            key: getattr(self, key)
            for key in RECOMMENDED[self.algorithm]
            if key not in self.model_fields_set
        }

    @field_validator("codec", "anchor_codec", "buffer_codec")
    @classmethod
    def _codec_parses(cls, spec: str) -> str:
        from gossipgrad.compression import from_spec

        return from_spec(spec).spec

    @model_validator(mode="after")
    def _background_rounds_fit(self) -> GossipSection:
        if self.state_device == "host" and (
            self.background_rounds or self.algorithm == "ef-gradient"
        ):
            raise ValueError(
                "state_device = host moves the parameters to the host copy at each round "
                "boundary, on the training thread: not with ef-gradient (it averages "
                "gradients every step) or background_rounds"
            )
        if self.background_rounds and self.algorithm == "ef-gradient":
            raise ValueError(
                "background_rounds runs choco's and diloco's rounds beside training; "
                "ef-gradient needs its average before the step, in the training thread"
            )
        if self.algorithm == "exact-diloco" and (self.background_rounds or self.overlap is True):
            raise ValueError(
                "exact-diloco takes each phase's mean before the next phase starts, so every "
                "replica starts it from the same anchor: set background_rounds and overlap "
                "to false"
            )
        if self.qsr_alpha > 0 and self.algorithm != "exact-diloco":
            raise ValueError(
                "qsr_alpha sets exact-diloco's phase lengths from the learning rate; "
                f"{self.algorithm} does not use it: leave it at 0"
            )
        if self.background_rounds and self.algorithm == "diloco" and self.overlap is True:
            raise ValueError(
                "diloco: background_rounds and overlap both hide a phase's exchange behind "
                "the next phase; choose one (background_rounds hides its CPU work too)"
            )
        return self

    @model_validator(mode="after")
    def _topology_known(self) -> GossipSection:
        from gossipgrad.peer.membership.topology import topology_from_name

        topology_from_name(self.topology, seed=0, degree=self.degree)
        topology_from_name(self.anchor_topology, seed=0)
        return self
