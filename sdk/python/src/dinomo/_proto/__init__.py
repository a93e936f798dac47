"""Generated gRPC stubs (tools/gen_stubs.py from proto/proto/*.proto): do not edit."""
