"""Wire contract of every service: .proto files and the Python generated from them."""
