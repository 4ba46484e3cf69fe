"""The domains requests are routed by: Spec-Bench's categories."""

DOMAINS = ("translation", "summarization", "qa", "math_reasoning", "rag", "writing", "roleplay",
           "reasoning", "math", "coding", "extraction", "stem", "humanities")
