"""The domains requests are routed by and drafters specialise in: Spec-Bench's
categories. Here, apart from the router, because drafter training names them too
(services share names through `speculative`, never each other's internals)."""

DOMAINS = ("translation", "summarization", "qa", "math_reasoning", "rag", "writing", "roleplay",
           "reasoning", "math", "coding", "extraction", "stem", "humanities")
