"""The verifier: the target model behind gRPC, verifying many requests' draft trees per forward pass."""
