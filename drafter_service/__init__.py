"""Drafters and, later, the drafter pool and its gRPC servicer."""
