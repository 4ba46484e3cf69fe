"""Client-facing router: validation, drafter choice, the draft/verify coordinator."""
