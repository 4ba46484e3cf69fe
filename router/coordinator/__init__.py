"""Drive one request through draft/verify rounds over gRPC (sequential rounds).

The verifier owns the request's KV cache and the pending (last verified)
token; each drafter keeps its own context, which the coordinator keeps in
step by sending only the tokens verified since the last round.

`Coordinator.run` is the loop, shaped as the in-process one
(`speculative.decoding.generate`): a round prefills (the first, or to
resume) or drafts, verifies and learns, each a step of the request's
`Request` (`rounds`); `speculative.stopping.clip` ends the output where the
in-process loop would.

A request drafted by prompt lookup or the suffix drafter, or decoded plainly,
can run its rounds on the verifier itself (`Job.verifier_drafting`, the Decode
call): the verifier drafts from the request's text (prompt lookup) or from a
suffix index of the texts of its requests in the request's memory namespace,
this one's included (verifier_service.drafting), and streams each round's
verdict back, with no hop to a pool or back to the router between rounds; the
router clips, counts and forwards the rounds as they come. Any other request
that is not pipelined runs its rounds on the verifier the same way while
adaptive lengths give none of its pool drafters (all but those two) a draft:
drafted there by the first of its drafters the verifier runs, if any (at the
length its control chooses for a draft that asks no pool), else plain (the
target's candidates come back each round for a drafter that learns from them).

A request has one drafter or several. One drafter's tree goes to the
verifier as it is. Several drafters are all asked each round (at the same
time, from a small thread pool), and their trees are fused into one
(`speculative.fusion.fuse`: shared prefixes merged, nodes weighted by each
drafter's reliability on the request's domain, at most `tree_budget` nodes)
that the verifier checks in one pass. Each of them is a request of its own
in its pool, with its own id (`request_id/kind`) and its own random stream
(drafter i draws from stream 1 + i): fused sampling is exact only when the
drafters draw independently (docs/DESIGN-NOTES.md, invariant 5). Every
drafter's own proposed and accepted tokens are counted, so that routing
learns which drafter earned the accepted tokens.

Pipelined (`Job.pipelined`, PEARL's post-verify across processes): while the
verifier checks a round's tree, the drafters already draft the next round
past the tree's likeliest path (`speculative.pipeline`); when the verdict
keeps that path, the next round's tree is ready at once, else the work is
dropped and the round drafts as usual. With adaptive speculation
(`router.adaptive`) the draft length follows each request's acceptance and the
verifier's load; a length of 1 when acceptance is poor is pre-verify: the
first draft token goes to the verifier while the rest is drafted ahead. Every
draft and verify call is timed into the request's trace, which shows the
overlap and gives each side's idle fraction.

Failures degrade, never corrupt: a drafter that dies or lost its state is
replaced (another pool, or no drafting at all: an empty tree, also inside a
fusion), and a verifier that lost the request is prefilled again with every
verified token. Both keep the output exactly the target's, because only the
verifier decides tokens and a request prefilled again draws from a fresh
random stream (`resumed`; docs/DESIGN-NOTES.md, invariant 5).

The package, a module each:
    channels     the gRPC channels to the services, with the cluster secret
    job          a request as the coordinator runs it, and its deadline
    services     what the sides reach: services listed, channels, threads, pass costs
    side         a request held at one service of a kind, failed replicas left out
    verify_side  the verifier side (prefill, verify, Decode)
    draft_side   the draft side: each drafter's pool, several drafters' trees fused
    rounds       one request's round steps
    loop         the `Coordinator`: the loop, and what its requests learn together
"""

from .channels import Channels
from .job import Cancelled, DeadlineExceeded, Job, NoService
from .loop import Coordinator
from .verify_side import DECODE_ROUNDS, SPARE_SLOTS

__all__ = ["Cancelled", "Channels", "Coordinator", "DECODE_ROUNDS", "DeadlineExceeded", "Job", "NoService",
           "SPARE_SLOTS"]
